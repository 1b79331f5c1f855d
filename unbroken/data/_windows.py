"""One window of token-budget batching: measure, sort by length, cut, shuffle the batches.

``cut_window`` is a pure function of the window's samples, their lengths, the budget and a
seed, which is what makes a window recomputable on resume. ``WindowFetch`` fetches a window's
samples (seeded per sample, as ``unbroken.MapLoader`` does) in the main process to measure
them; without workers it keeps them, so the batches are served without a second read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._loader import _SeededFetch

_MISS = object()


def longest_field(item: Any) -> int:
    """The default ``length_fn``: the longest field of a tuple item, else ``len(item)``."""
    if isinstance(item, tuple):
        return max((len(f) for f in item), default=0)
    return len(item)


class WindowFetch(_SeededFetch):
    """Seeded fetching; without workers, a window's samples (read to measure them) are kept
    and handed out again instead of being read twice."""

    def __init__(self, dataset: Any, seed: int, reseed_globals: Any, keep: bool) -> None:
        super().__init__(dataset, seed, reseed_globals)
        self.keep = keep
        self.cache: dict[tuple[int, int], Any] = {}

    def window(self, epoch: int, indices: np.ndarray) -> list[Any]:
        keys = [(epoch, int(i)) for i in indices]
        items = super().__getitems__(keys)
        if self.keep:
            self.cache = dict(zip(keys, items, strict=True))
        return items

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        if self.cache:
            got = [self.cache.pop((k[0], k[1]), _MISS) for k in keys]
            if not any(g is _MISS for g in got):
                return got
        return super().__getitems__(keys)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "cache": {}}


def cut_window(
    idx: np.ndarray, lengths: np.ndarray, budget: int, seed: int | None
) -> list[list[int]]:
    """Batches of ``idx``: sorted by length (stable), cut greedily so that each batch's padded
    size (count x longest) is <= ``budget``, in an order shuffled from ``seed`` (None: kept)."""
    by_length = np.argsort(lengths, kind="stable")
    batches = _cut(idx[by_length], lengths[by_length], budget)
    if seed is not None and len(batches) > 1:
        perm = np.random.Generator(np.random.PCG64(seed)).permutation(len(batches))
        batches = [batches[k] for k in perm]
    return batches


def _cut(idx: np.ndarray, lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Greedy cut of length-sorted samples: count x longest <= budget per batch."""
    out: list[list[int]] = []
    begin = 0
    for j in range(len(idx)):
        if j > begin and (j - begin + 1) * int(lengths[j]) > budget:
            out.append(idx[begin:j].tolist())
            begin = j
    if begin < len(idx):
        out.append(idx[begin:].tolist())
    return out
