"""Sequential shards (e.g. a Hugging Face ``IterableDataset``) resumed exactly, with workers.

:class:`IterableShards` reads sources that can only be iterated -- no random access inside a
shard -- but come in shards that can each be opened at a sample offset. Epoch ``e``'s stream is
the shards in an order fixed by (seed, e), each read through in its own order; the position is
(epoch, shard cursor, offset in that shard), a count in that stream, so it does not depend on
``num_workers``, the world size or the batch size.

Workers read disjoint shards: the unit of work handed to a worker is the rest of one shard (from
the position's offset for the first), returned whole, and the main process cuts the stream into
batches. Prefetching therefore holds up to ``prefetch_factor * num_workers`` shards in memory:
use many small shards (``to_iterable_dataset(num_shards=...)`` with shards of a few thousand
samples). A resume opens the current shard at its offset -- the source's own skip, within one
shard -- and never replays the stream before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from ..errors import ConfigError, DataError
from . import _seeding, _workers
from ._contract import LoaderBase

STREAM_VERSION = 1
_HF_BATCH = 1000


class HFShard:
    """Shard ``index`` of a Hugging Face ``IterableDataset``, opened at a sample offset."""

    def __init__(self, dataset: Any, index: int) -> None:
        self.dataset, self.index = dataset, index

    def __call__(self, start: int) -> Iterator[Any]:
        shard = self.dataset.shard(num_shards=self.dataset.num_shards, index=self.index)
        if start:
            shard = shard.skip(start)
        # .iter(), not iter(): inside a torch worker the latter splits the shard up again among
        # the workers (the dataset is a torch IterableDataset), and each must read it whole.
        for batch in shard.iter(batch_size=_HF_BATCH):
            columns = list(batch)
            for i in range(len(batch[columns[0]]) if columns else 0):
                yield {c: batch[c][i] for c in columns}


def _openers(source: Any) -> list[Callable[[int], Any]]:
    if hasattr(source, "num_shards") and callable(getattr(source, "shard", None)):
        return [HFShard(source, i) for i in range(int(source.num_shards))]
    if isinstance(source, Sequence) and all(callable(s) for s in source):
        return list(source)
    raise ConfigError(
        f"IterableShards needs a sharded source: a Hugging Face IterableDataset (num_shards, "
        f"shard()), or a list of callables open(start) -> iterator over one shard from sample "
        f"start; got {type(source).__qualname__}"
    )


class _Read(tud.Dataset[Any]):
    """A job: (epoch, shard, start) -> every sample of the shard from ``start``, processed."""

    def __init__(self, openers: list[Callable[[int], Any]], seed: int, augment: Any) -> None:
        self.openers, self.seed, self.augment = openers, seed, augment

    def __getitem__(self, key: tuple[int, int, int]) -> list[Any]:
        epoch, shard, start = key
        out = []
        for offset, sample in enumerate(self.openers[shard](start), start):
            if self.augment is not None:
                g = torch.Generator()
                g.manual_seed(_seeding.sample_seed(self.seed, epoch, (shard << 32) | offset))
                sample = self.augment(sample, g)
            out.append(sample)
        return out

    def __len__(self) -> int:
        return len(self.openers)


class _Jobs:
    def __init__(self, loader: IterableShards) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        lo = self._loader  # the position when the pass starts (it moves as batches are yielded)
        return self._jobs(lo.epoch, lo.shard_order(lo.epoch), lo._cursor, lo._offset)

    @staticmethod
    def _jobs(
        epoch: int, order: np.ndarray, cursor: int, offset: int
    ) -> Iterator[list[tuple[int, int, int]]]:
        for k in range(cursor, len(order)):
            yield [(epoch, int(order[k]), offset if k == cursor else 0)]


def _one(batch: list[list[Any]]) -> list[Any]:
    return batch[0]


class IterableShards(LoaderBase):
    """A resumable loader over sequential shards; position = samples in a global stream.

    ``source``: a Hugging Face ``datasets.IterableDataset`` with several shards (e.g.
    ``Dataset.to_iterable_dataset(num_shards=64)`` or ``load_dataset("json", data_files=[...],
    streaming=True)``), or a list of callables ``open(start)`` returning an iterator over one
    shard from sample ``start``. ``batch_size`` is global; rank ``r`` of ``W`` takes a
    contiguous slice of each batch. ``augment(sample, generator)`` gets a generator seeded from
    (seed, epoch, shard, offset). ``last_ids`` are the ``(shard, offset)`` pairs of the batch
    yielded last::

        ds = datasets.Dataset.from_json("train.jsonl").to_iterable_dataset(num_shards=32)
        loader = unbroken.data.IterableShards(ds, batch_size=64, seed=0, num_workers=2)
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        augment: Callable[[Any, torch.Generator], Any] | None = None,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self._openers = _openers(source)
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        if num_workers > 0 and len(self._openers) < 2:
            raise DataError(
                f"num_workers={num_workers} needs a source with several shards (workers read "
                f"whole shards), but this one has {len(self._openers)}; re-shard it (e.g. "
                "Dataset.to_iterable_dataset(num_shards=N), several data_files), or use "
                "num_workers=0"
            )
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.collate_fn = collate_fn or tud.default_collate
        self._init_base(rank, world_size)
        self.batch_size = int(batch_size)
        if self.batch_size < 1 or self.batch_size % self.world_size:
            raise ConfigError(
                f"batch_size must be >= 1 and divisible by world_size {self.world_size}, got "
                f"{batch_size}"
            )
        self._cursor = 0  # index, in the epoch's shard order, of the shard being read
        self._offset = 0  # samples of that shard consumed
        self._ended = False
        self.last_ids: list[tuple[int, int]] = []
        self._inner = _workers.inner_loader(
            self,
            _Read(self._openers, self.seed, augment),
            _Jobs(self),
            seed=self.seed,
            num_workers=num_workers,
            collate_fn=_one,
            pin_memory=False,
            persistent_workers=False,
            prefetch_factor=prefetch_factor,
            worker_init_fn=None,
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
        )

    @property
    def num_shards(self) -> int:
        return len(self._openers)

    def shard_order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of the shards (a permutation fixed by (seed, epoch))."""
        return _seeding.epoch_order(self.seed, epoch, len(self._openers), self.shuffle)

    def close(self) -> None:
        _workers.shutdown(self._inner)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position, self._cursor, self._offset = int(epoch), 0, 0, 0
        self._ended = False

    def __iter__(self) -> Iterator[Any]:
        if self._ended:
            self.epoch, self.position, self._cursor, self._offset = self.epoch + 1, 0, 0, 0
        self._ended = False
        order = self.shard_order(self.epoch)
        # Samples read but not yet yielded: (shard, offset, sample), in stream order.
        buf: deque[tuple[int, int, Any]] = deque()
        k, start = self._cursor, self._offset
        for samples in _workers.start(self._inner, self):
            shard = int(order[k])
            buf.extend((shard, start + i, s) for i, s in enumerate(samples))
            k, start = k + 1, 0
            while len(buf) >= self.batch_size:
                yield self._emit(buf, self.batch_size, order)
        if buf and not self.drop_last and len(buf) >= self.world_size:
            yield self._emit(buf, len(buf), order)
        self._cursor, self._offset = len(order), 0
        self._ended = True

    def _emit(self, buf: deque[tuple[int, int, Any]], n: int, order: np.ndarray) -> Any:
        taken = [buf.popleft() for _ in range(n)]
        self.last_ids = [(s, o) for s, o, _ in taken]
        # The position after this batch: the shard of its last sample, one past that sample.
        last_shard, last_off = taken[-1][0], taken[-1][1]
        self._cursor = int(np.flatnonzero(order == last_shard)[0])
        self._offset = last_off + 1
        if buf and buf[0][0] != last_shard:  # the batch ended a shard exactly
            self._cursor, self._offset = self._cursor + 1, 0
        self._count(n)
        w, r = self.world_size, self.rank
        local = taken[r * n // w : (r + 1) * n // w]
        return self.collate_fn([s for _, _, s in local])

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STREAM_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "cursor": self._cursor,
            "offset": self._offset,
            "ended": self._ended,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_shards": len(self._openers),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STREAM_VERSION:
            raise DataError(f"shard stream state has version {state_dict.get('version')!r}")
        for key, now in (
            ("num_shards", len(self._openers)),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if state_dict[key] != now:
                raise DataError(
                    f"shard stream: {key} was {state_dict[key]!r} when saved but is {now!r} "
                    "now, so the saved position would point at other samples; use the same "
                    "source and settings, or start the stream fresh under a new component name"
                )
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])
        self._cursor = int(state_dict["cursor"])
        self._offset = int(state_dict["offset"])
        self._ended = bool(state_dict.get("ended", False))
