"""Seeds derived from (seed, epoch, index): the same numbers in any process, at any resume point."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import ConfigError

_MASK63 = (1 << 63) - 1


def derive(*parts: int, domain: bytes = b"") -> int:
    """A 63-bit seed hashed from integers (xxh3; stable across processes and platforms)."""
    return xxhash.xxh3_64_intdigest(domain + struct.pack(f"<{len(parts)}q", *parts)) & _MASK63


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample of one epoch: ``derive(seed, epoch, index)``."""
    return derive(seed, epoch, index, domain=b"sample")


def batch_seed(seed: int, keys: Sequence[tuple[int, int]]) -> int:
    """The seed of a batch's collate: hashed from (seed, and each sample's (epoch, index))."""
    flat = [seed, *(v for key in keys for v in key)]
    return derive(*flat, domain=b"collate")


def epoch_order(seed: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
    """Epoch ``epoch``'s order of ``n`` samples: a permutation fixed by (seed, epoch)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(derive(seed, epoch, domain=b"order")))
    return rng.permutation(n).astype(np.int64, copy=False)


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A ``torch.Generator`` seeded for one sample of one epoch (what ``get_sample`` receives)."""
    g = torch.Generator()
    g.manual_seed(sample_seed(seed, epoch, index))
    return g


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) global streams; for model init etc."""
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)


STREAMS = ("python", "numpy", "torch")


def streams_of(reseed: Any) -> tuple[str, ...]:
    """The global streams a loader reseeds per sample: True (all), False (none), or names.

    Each costs per sample (about 4.6 us Python's, 3.2 us NumPy's, 1.3 us torch's on the dev
    machine), and saving and restoring NumPy's around a batch in the main process about 0.12 ms:
    a dataset whose augmentation draws only from torch's stream can say ``"torch"``.
    """
    if reseed is True:
        return STREAMS
    if reseed is False or reseed is None:
        return ()
    names = (reseed,) if isinstance(reseed, str) else tuple(reseed)
    bad = [n for n in names if n not in STREAMS]
    if bad:
        raise ConfigError(
            f"reseed_globals: unknown stream(s) {bad}; give True, False, or some of {STREAMS}"
        )
    return tuple(n for n in STREAMS if n in names)


def seed_globals(s: int, streams: tuple[str, ...] = STREAMS) -> None:
    """Seed this process's global Python, NumPy and torch CPU streams (CUDA untouched)."""
    if "python" in streams:
        random.seed(s)
    if "numpy" in streams:
        np.random.seed(s & 0xFFFFFFFF)
    if "torch" in streams:
        torch.default_generator.manual_seed(s)


@contextmanager
def preserved_globals(streams: tuple[str, ...] = STREAMS) -> Iterator[None]:
    """Leave the global streams exactly as they were (sample seeding in the main process)."""
    py = random.getstate() if "python" in streams else None
    np_state = np.random.get_state() if "numpy" in streams else None
    t = torch.get_rng_state() if "torch" in streams else None
    try:
        yield
    finally:
        if py is not None:
            random.setstate(py)
        if np_state is not None:
            np.random.set_state(np_state)
        if t is not None:
            torch.set_rng_state(t)


def sample_seeds(seed: int, keys: Sequence[tuple[int, int]]) -> list[int]:
    """``[sample_seed(seed, epoch, index) for epoch, index in keys]``, with less work a key."""
    h, pack = xxhash.xxh3_64_intdigest, _Q3.pack
    return [h(b"sample" + pack(seed, e, i)) & _MASK63 for e, i in keys]


_Q3 = struct.Struct("<3q")
