"""Data layer: resumable loaders whose position is a count of samples in a global stream."""

from ._corpus import EpochOrder, TextCorpus
from ._iterable import IterableLoader
from ._loader import DataLoader
from ._seeding import derive, epoch_order, sample_generator, sample_seed, seed_everything
from ._tokens import TokenBatchLoader
from ._vocab import CharVocab, WordVocab

__all__ = [
    "CharVocab",
    "DataLoader",
    "EpochOrder",
    "IterableLoader",
    "TextCorpus",
    "TokenBatchLoader",
    "WordVocab",
    "derive",
    "epoch_order",
    "sample_generator",
    "sample_seed",
    "seed_everything",
]
