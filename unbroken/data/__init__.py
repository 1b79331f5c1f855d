"""Data layer: resumable loaders whose position is a count of samples in a global stream."""

from ._contract import Loader, LoaderBase
from ._corpus import EpochOrder, TextCorpus
from ._iterable import IterableLoader
from ._loader import DataLoader
from ._sampler import SamplerLoader
from ._seeding import derive, epoch_order, sample_generator, sample_seed, seed_everything
from ._sequential import IterableShards
from ._shards import JsonlShards, ShardOrder
from ._tokens import TokenBatchLoader
from ._vocab import CharVocab, WordVocab
from ._workers import protect_workers

__all__ = [
    "CharVocab",
    "DataLoader",
    "EpochOrder",
    "IterableLoader",
    "IterableShards",
    "JsonlShards",
    "Loader",
    "LoaderBase",
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
