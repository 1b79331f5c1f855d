"""Do a tensor's chunks cover every element exactly once? For any number of chunks.

The chunks (boxes: offsets and sizes, each already checked to lie inside the tensor) tile the
tensor exactly when the number of chunks covering each element is 1. Only the dimensions along
which some chunk is split matter:

- none: exactly one chunk;
- one (row or column sharding, the usual case): sort by offset and sweep -- each chunk starts
  where the previous one ended, the first at 0, the last at the edge. O(n log n);
- several (2-D sharding, FSDP with tensor parallelism): the count covering an element is the
  prefix sum of the boxes' signed corners (+1 at each lower corner, the sign flipping with
  each coordinate taken at its end). The chunks tile the tensor exactly when their corners,
  summed, are the tensor's own: sort every corner, sum the signs of equal ones. O(n 2^d log n)
  in numpy, 2^d int64 keys a chunk. Up to :data:`MAX_SPLIT_DIMS` dimensions (a checkpoint of
  ours splits a tensor along one or two); more is refused.
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptCheckpointError

MAX_SPLIT_DIMS = 3
CORNER_BUDGET = 1 << 23
"""Corners (chunks x 2^split dimensions) checked at most for one tensor."""


def covers(shape: tuple[int, ...], lo: np.ndarray, size: np.ndarray, at: str) -> bool:
    """Whether the boxes ``lo``/``size`` (int64, one row a chunk that holds elements, each
    inside ``shape``, which has elements) cover ``shape`` exactly once."""
    n = lo.shape[0]
    if n == 0:
        return False
    full = np.asarray(shape, dtype=np.int64)
    split = np.flatnonzero(((lo != 0) | (size != full)).any(axis=0))
    if split.size == 0:
        return n == 1
    if split.size == 1:
        k = int(split[0])
        order = np.argsort(lo[:, k], kind="stable")
        starts = lo[order, k]
        ends = starts + size[order, k]
        return bool(
            starts[0] == 0 and ends[-1] == shape[k] and np.array_equal(starts[1:], ends[:-1])
        )
    d = int(split.size)
    if d > MAX_SPLIT_DIMS or n << d > CORNER_BUDGET:
        raise CorruptCheckpointError(
            f"{at}: {n} chunks split it along {d} dimensions, more than unbroken checks (a "
            f"checkpoint of ours splits a tensor along at most {MAX_SPLIT_DIMS})"
        )
    low, high = lo[:, split], (lo + size)[:, split]
    dims = full[split]
    span = 1
    for v in dims.tolist():
        span *= v + 1
    # Every corner of every chunk, then the tensor's own with the opposite sign: what remains
    # after summing equal corners must be nothing. One int64 key a corner where they fit.
    total = (n + 1) << d
    linear = span < 1 << 62
    keys = np.empty(total, dtype=np.int64) if linear else np.empty((total, d), dtype=np.int64)
    weights = np.empty(total, dtype=np.int8)
    strides = np.cumprod(np.concatenate([[1], dims[:-1] + 1])).astype(np.int64)
    pos = 0
    for pattern in range(1 << d):
        pick = np.array([(pattern >> i) & 1 for i in range(d)], dtype=bool)
        sign = -1 if int(pick.sum()) % 2 else 1
        for corners, w in (
            (np.where(pick, high, low), sign),
            (np.where(pick, dims, 0)[None], -sign),
        ):
            m = corners.shape[0]
            keys[pos : pos + m] = corners @ strides if linear else corners
            weights[pos : pos + m] = w
            pos += m
    if linear:
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        starts = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]]))
    else:
        order = np.lexsort(keys.T[::-1])
        keys = keys[order]
        starts = np.flatnonzero(np.concatenate([[True], (keys[1:] != keys[:-1]).any(axis=1)]))
    return not np.add.reduceat(weights[order].astype(np.int64), starts).any()
