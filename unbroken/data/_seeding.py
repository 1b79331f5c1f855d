"""Seeds derived from (seed, epoch, index): the same numbers in any process, at any resume point."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import xxhash

_MASK63 = (1 << 63) - 1


def derive(*parts: int, domain: bytes = b"") -> int:
    """A 63-bit seed hashed from integers (xxh3; stable across processes and platforms)."""
    return xxhash.xxh3_64_intdigest(domain + struct.pack(f"<{len(parts)}q", *parts)) & _MASK63


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return derive(seed, epoch, index, domain=b"sample")


def epoch_order(seed: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
    """Epoch ``epoch``'s order of ``n`` samples: a permutation fixed by (seed, epoch)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(derive(seed, epoch, domain=b"order")))
    return rng.permutation(n).astype(np.int64, copy=False)


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(sample_seed(seed, epoch, index))
    return g


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) global streams; for model init etc."""
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)


def seed_globals(s: int) -> None:
    """Seed this process's global Python, NumPy and torch CPU streams (CUDA untouched)."""
    random.seed(s)
    np.random.seed(s & 0xFFFFFFFF)
    torch.default_generator.manual_seed(s)


@contextmanager
def preserved_globals() -> Iterator[None]:
    """Leave the global streams exactly as they were (sample seeding in the main process)."""
    py, np_state, t = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(t)
