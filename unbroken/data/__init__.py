"""Data layer: resumable loaders whose position is a count of samples in a global stream."""

from .. import _lazy
from ._contract import Loader, LoaderBase
from ._corpus import EpochOrder, TextCorpus
from ._iterable import IterableLoader
from ._loader import MapLoader
from ._sampler import SamplerLoader
from ._seeding import derive, epoch_order, sample_generator, sample_seed, seed_everything
from ._sequential import IterableShards
from ._shards import JsonlShards, ShardOrder
from ._tokens import TokenBatchLoader
from ._vocab import CharVocab, WordVocab
from ._workers import protect_workers

# The first releases' name, kept for one release: it read as torch's class, whose signature
# (per-rank batch size, no shuffle by default, samplers) this loader does not have.
_DEPRECATED = {"DataLoader": "unbroken.data.MapLoader"}

__getattr__, __dir__ = _lazy.exports(__name__, {}, _DEPRECATED)

__all__ = [
    "CharVocab",
    "EpochOrder",
    "IterableLoader",
    "IterableShards",
    "JsonlShards",
    "Loader",
    "LoaderBase",
    "MapLoader",
    "SamplerLoader",
    "ShardOrder",
    "TextCorpus",
    "TokenBatchLoader",
    "WordVocab",
    "derive",
    "epoch_order",
    "protect_workers",
    "sample_generator",
    "sample_seed",
    "seed_everything",
]
