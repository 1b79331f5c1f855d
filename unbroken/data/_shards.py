"""Sharded JSONL data: many files read as one resumable stream, by any number of workers.

:class:`JsonlShards` is a list of JSON-lines files seen as one map-style dataset: item ``i`` is
line ``i - start(shard)`` of its shard, decoded with :func:`json.loads`. Every shard has an
offset index (the one :class:`unbroken.data.TextCorpus` uses: built once, cached beside the file
or in ``cache_dir``), so any line is one slice of a memory-mapped file.

Its :meth:`JsonlShards.stream_order` is the epoch's order that :class:`unbroken.MapLoader`
follows: the shards in an order fixed by (seed, epoch), and inside each shard its lines in an
order fixed by (seed, epoch, shard) -- an exact permutation, no shuffle buffer. A slice of that
order costs O(number of shards + the shard it falls in), so a resume at sample 10^6 costs what
one at sample 10 does, and a batch reads one or two shards. Because the loader decides the
batches in the main process, the stream is the same for any ``num_workers``, world size and
batch size; each worker reads only the lines of the batches it is handed.

The loader saves the shard list (each file's name, size and content hash) with its position and
refuses a resume when it changed -- a file added, removed, resized or edited -- since the saved
position would then point at other lines.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, DataError
from . import _seeding
from ._index import LineIndex

SHARDS_VERSION = 1
# str, not bytes: json.loads(bytes) first sniffs the encoding (UTF-8 is checked at indexing).
_decode = json.JSONDecoder().decode


def _expand(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """A glob pattern (sorted matches), one path, or a list of paths (kept in the given order)."""
    if isinstance(paths, (str, os.PathLike)):
        text = os.fspath(paths)
        if glob.has_magic(text):
            found = sorted(glob.glob(text))
            if not found:
                raise DataError(f"no shard file matches {text!r}")
            return found
        return [text]
    out = [os.fspath(p) for p in paths]
    if not out:
        raise ConfigError("JsonlShards needs at least one shard file")
    return out


def _open(name: str, cache_dir: str | None) -> LineIndex:
    if not os.path.exists(name):
        raise DataError(f"shard {name} does not exist (a dangling link, or moved); restore it")
    if not os.path.isfile(name):
        raise DataError(f"shard {name} is not a regular file; give the JSONL files themselves")
    try:
        return LineIndex(name, cache_dir)
    except DataError as e:
        raise DataError(f"shard {name} cannot be read: {e}") from e


class ShardOrder:
    """Epoch ``epoch``'s order of the items of shards of ``sizes`` items; slices are cheap.

    The shards are permuted from (seed, epoch), then each shard's lines from (seed, epoch,
    shard); ``order[a:b]`` permutes only the shards that slice touches.
    """

    def __init__(
        self, sizes: np.ndarray, seed: int, epoch: int, *, shuffle: bool, shuffle_lines: bool
    ) -> None:
        self.seed, self.epoch = int(seed), int(epoch)
        self.shuffle, self.shuffle_lines = shuffle, shuffle and shuffle_lines
        sizes = np.asarray(sizes, dtype=np.int64)
        self.base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.sizes = sizes
        if shuffle:
            rng = np.random.Generator(
                np.random.PCG64(_seeding.derive(seed, epoch, domain=b"shards"))
            )
            self.perm = rng.permutation(len(sizes)).astype(np.int64)
        else:
            self.perm = np.arange(len(sizes), dtype=np.int64)
        self.ends = np.cumsum(sizes[self.perm])
        self.starts = self.ends - sizes[self.perm]
        self.n = int(self.ends[-1]) if len(sizes) else 0
        self._inner: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: slice) -> np.ndarray:
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("ShardOrder supports contiguous slices only")
        return self.slice(s.start or 0, self.n if s.stop is None else s.stop)

    def _lines(self, shard: int) -> np.ndarray:
        got = self._inner.get(shard)
        if got is None:
            size, base = int(self.sizes[shard]), int(self.base[shard])
            if self.shuffle_lines:
                seed = _seeding.derive(self.seed, self.epoch, shard, domain=b"shard")
                got = np.random.Generator(np.random.PCG64(seed)).permutation(size) + base
            else:
                got = np.arange(base, base + size, dtype=np.int64)
            if len(self._inner) >= 4:  # a batch touches one or two shards
                self._inner.pop(next(iter(self._inner)))
            self._inner[shard] = got
        return got

    def slice(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, int(start)), min(self.n, int(stop))
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        out = []
        k = int(np.searchsorted(self.ends, start, side="right"))
        while k < len(self.perm) and self.starts[k] < stop:
            lo, hi = int(self.starts[k]), int(self.ends[k])
            lines = self._lines(int(self.perm[k]))
            out.append(lines[max(start, lo) - lo : min(stop, hi) - lo])
            k += 1
        return np.concatenate(out).astype(np.int64, copy=False)


class JsonlShards:
    """JSON-lines shard files as one dataset for :class:`unbroken.MapLoader`.

    ``paths``: a list of files (kept in that order: a shard's number is its place in it), one
    file, or a glob pattern (its matches, sorted). Item ``i`` is a record of shard ``k`` decoded
    by ``json.loads`` and passed through ``transform(record)``; with ``augment(record,
    generator)`` instead, each sample gets a ``torch.Generator`` seeded from (seed, epoch,
    index), so random augmentation is the same for any worker count and resume point::

        shards = unbroken.data.JsonlShards("data/train-*.jsonl", transform=encode)
        loader = unbroken.MapLoader(shards, batch_size=64, seed=0, num_workers=2)

    ``shuffle_lines=False`` keeps each shard's lines in file order (only the shard order is
    shuffled): reads are then sequential, kinder to slow disks. Errors are
    :class:`unbroken.DataError` naming the file (and line): a missing or unreadable shard, a
    line that is not JSON or not UTF-8, a shard list that changed since a checkpoint.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        transform: Callable[[Any], Any] | None = None,
        augment: Callable[[Any, torch.Generator], Any] | None = None,
        shuffle_lines: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if transform is not None and augment is not None:
            raise ConfigError("give transform(record) or augment(record, generator), not both")
        cache = None if cache_dir is None else os.fspath(cache_dir)
        self.paths = _expand(paths)
        dup = sorted({p for p in self.paths if self.paths.count(p) > 1})
        if dup:
            raise ConfigError(f"shard list names {dup[0]} more than once")
        self.files = [_open(p, cache) for p in self.paths]
        self.sizes = np.array([len(f) for f in self.files], dtype=np.int64)
        empty = [p for p, n in zip(self.paths, self.sizes, strict=True) if n == 0]
        if empty:
            raise DataError(f"shard {empty[0]} holds no lines; remove it from the shard list")
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.transform, self.augment = transform, augment
        self.shuffle_lines = bool(shuffle_lines)
        if augment is not None:
            self.get_sample = self._augmented  # the MapLoader's per-sample generator protocol

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_shards(self) -> int:
        return len(self.files)

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, line) of item ``index``, both 0-based."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"item {index} out of range (0..{len(self) - 1})")
        k = int(np.searchsorted(self.starts, index, side="right")) - 1
        return k, index - int(self.starts[k])

    def record(self, index: int) -> Any:
        """Item ``index`` decoded, before ``transform``/``augment``."""
        k, line = self.locate(index)
        f = self.files[k]
        raw = f.read(int(f.offsets[line]), int(f.offsets[line + 1]))
        try:
            return _decode(raw.decode("utf-8"))
        except ValueError as e:
            raise DataError(
                f"shard {self.paths[k]}: line {line + 1} is not valid JSON ({e}); fix or drop it"
            ) from None

    def __getitem__(self, index: int) -> Any:
        rec = self.record(index)
        return rec if self.transform is None else self.transform(rec)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch at once: shard lookups and line offsets gathered per shard with numpy (the
        per-sample cost left is one slice of the mapping and ``json.loads``)."""
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"items {indices} out of range (0..{len(self) - 1})")
        ks = np.searchsorted(self.starts, idx, side="right") - 1
        lines = idx - self.starts[ks]
        out: list[Any] = [None] * len(idx)
        for k in np.unique(ks).tolist():
            at = np.flatnonzero(ks == k)
            f, mine = self.files[k], lines[at]
            offsets = f.offsets
            los, his = offsets[mine].tolist(), offsets[mine + 1].tolist()
            mm = f._map()
            for j, lo, hi, line in zip(at.tolist(), los, his, mine.tolist(), strict=True):
                try:
                    rec = _decode(mm[lo:hi].decode("utf-8"))
                except ValueError as e:
                    raise DataError(
                        f"shard {self.paths[k]}: line {line + 1} is not valid JSON ({e}); fix "
                        "or drop it"
                    ) from None
                out[j] = rec if self.transform is None else self.transform(rec)
        return out

    def _augmented(self, index: int, generator: torch.Generator) -> Any:
        assert self.augment is not None
        return self.augment(self.record(index), generator)

    def stream_order(self, seed: int, epoch: int, shuffle: bool) -> ShardOrder:
        """Epoch ``epoch``'s order (what :class:`unbroken.MapLoader` follows)."""
        return ShardOrder(
            self.sizes, seed, epoch, shuffle=shuffle, shuffle_lines=self.shuffle_lines
        )

    # ---- what the loader saves with its position ----------------------------------------------

    def source_state(self) -> dict[str, Any]:
        return {
            "version": SHARDS_VERSION,
            "shuffle_lines": self.shuffle_lines,
            "shards": [
                [p, int(f.meta["size"]), f.meta["content_xxh3"]]
                for p, f in zip(self.paths, self.files, strict=True)
            ],
        }

    def check_source_state(self, saved: dict[str, Any]) -> None:
        """Raise :class:`unbroken.DataError` naming the first shard that is not as saved."""
        if saved.get("version") != SHARDS_VERSION:
            raise DataError(f"shard list state has version {saved.get('version')!r}")
        then = {p: (size, h) for p, size, h in saved["shards"]}
        now = {p: (size, h) for p, size, h in self.source_state()["shards"]}
        hint = (
            "; the saved position would point at other records. Restore the shard list, or "
            "start the stream fresh under a new component name "
            "(Run(..., allow_missing=[new], allow_unexpected=[old]))"
        )
        for p in then:
            if p not in now:
                raise DataError(f"shard {p} was in the shard list when saved but is not now{hint}")
        for p in now:
            if p not in then:
                raise DataError(f"shard {p} was added to the shard list since the save{hint}")
        for p, (size, h) in then.items():
            if now[p][0] != size:
                raise DataError(
                    f"shard {p} changed size since the save ({size:,} bytes then, "
                    f"{now[p][0]:,} now){hint}"
                )
            if now[p][1] != h:
                raise DataError(f"shard {p} changed content since the save (same size){hint}")
        if [s[0] for s in saved["shards"]] != self.paths:
            raise DataError(f"the shard list was reordered since the save{hint}")
        if bool(saved.get("shuffle_lines", True)) != self.shuffle_lines:
            raise DataError(
                f"shuffle_lines was {saved.get('shuffle_lines')!r} when saved, "
                f"{self.shuffle_lines!r} now{hint}"
            )

    def __repr__(self) -> str:
        return f"JsonlShards({self.num_shards} shards, {len(self):,} records)"
