"""Data layer: resumable loaders whose position is a count of samples in a global stream."""

from ._iterable import IterableLoader
from ._loader import DataLoader
from ._seeding import derive, epoch_order, sample_generator, sample_seed, seed_everything

__all__ = [
    "DataLoader",
    "IterableLoader",
    "derive",
    "epoch_order",
    "sample_generator",
    "sample_seed",
    "seed_everything",
]
