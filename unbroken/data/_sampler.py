"""The user's own sampler or batch sampler, resumed exactly through its state_dict.

torch fetches batches ahead of the loop (workers, prefetching), so a sampler's live state is
ahead of what training consumed. :class:`SamplerLoader` draws every batch's indices from the
sampler in the main process and takes a snapshot of ``sampler.state_dict()`` right after each
batch; its own state is the snapshot of the batch *yielded* last. A resume loads that snapshot
into the sampler, and so does a new pass after one was abandoned mid-epoch (the prefetched,
unconsumed batches are drawn again).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import ConfigError, DataError
from . import _workers
from ._contract import LoaderBase
from ._loader import _SeededFetch

SAMPLER_VERSION = 1


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class _Draw:
    """The batch sampler torch's DataLoader runs: user indices -> (epoch, index) keys."""

    def __init__(self, loader: SamplerLoader) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        loader = self._loader
        epoch, pending = loader.epoch, loader._pending
        for global_idx, exhausted in loader._global_batches():
            state = copy.deepcopy(loader._source.state_dict())
            pending.append((global_idx, state, exhausted))
            yield [(epoch, i) for i in loader._local_slice(global_idx)]


class SamplerLoader(LoaderBase):
    """A map-style dataset read in the order of your own stateful ``sampler``/``batch_sampler``.

    The sampler needs ``state_dict()`` (the position after the last index its iterator
    produced) and ``load_state_dict()`` (the next ``iter()`` continues from there); a pass that
    ends should leave it ready for the next one. ``set_epoch(e)`` is called when it has one.
    Its indices are the *global* stream (the same on every rank): with ``world_size`` ranks
    each takes a contiguous slice of every batch, as :class:`unbroken.MapLoader` does::

        loader = unbroken.data.SamplerLoader(dataset, sampler=MySampler(...), batch_size=32,
                                             num_workers=2)

    A sampler without ``state_dict`` is refused: its position could only be found again by
    replaying it. Use :class:`unbroken.MapLoader` (its order is a function of (seed, epoch)).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        sampler: Any = None,
        batch_sampler: Any = None,
        batch_size: int | None = None,
        drop_last: bool = False,
        seed: int = 0,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        reseed_globals: bool | str | Sequence[str] = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if (sampler is None) == (batch_sampler is None):
            raise ConfigError("SamplerLoader needs exactly one of sampler= and batch_sampler=")
        source = sampler if sampler is not None else batch_sampler
        what = "sampler" if sampler is not None else "batch_sampler"
        if not _stateful(source):
            raise ConfigError(
                f"{what} {type(source).__qualname__} has no state_dict()/load_state_dict(), so "
                "its position cannot be saved (only replayed). Give it those two methods, or "
                "use unbroken.MapLoader(dataset, batch_size, shuffle=..., seed=...), whose "
                "order is a function of (seed, epoch) and resumes without a replay"
            )
        if sampler is not None and (batch_size is None or int(batch_size) < 1):
            raise ConfigError(f"a sampler needs batch_size >= 1, got {batch_size!r}")
        if batch_sampler is not None and batch_size is not None:
            raise ConfigError("batch_size comes from batch_sampler; do not pass both")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self._source = source
        self._batched = batch_sampler is not None
        self.batch_size = None if batch_size is None else int(batch_size)
        self.drop_last = bool(drop_last)
        self.seed = int(seed)
        self._init_base(rank, world_size)
        if self.batch_size is not None and self.batch_size % self.world_size:
            raise ConfigError(
                f"global batch_size {self.batch_size} is not divisible by world_size "
                f"{self.world_size}"
            )
        self.last_indices: list[int] = []
        self._pending: deque[tuple[list[int], Any, bool]] = deque()
        self._state: Any = None  # the sampler's state after the batch yielded last
        self._exhausted = False  # that batch ran the sampler out: the pass is over
        self._ended = False
        self._inner = _workers.inner_loader(
            self,
            _SeededFetch(dataset, self.seed, reseed_globals),
            _Draw(self),
            seed=self.seed,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
        )

    def close(self) -> None:
        """Shut down worker processes (a later iteration starts new ones)."""
        _workers.shutdown(self._inner)

    def _global_batches(self) -> Iterator[tuple[list[int], bool]]:
        """Global batches, each with whether drawing it ran the sampler out. (A short batch
        did: the sampler's state is then already that of its next pass, so a resume must not
        load it but see the epoch end.)"""
        it = iter(self._source)
        while True:
            if self._batched:
                batch = next(it, None)
                if batch is None:
                    return
                idx, exhausted = [int(i) for i in batch], False
            else:
                assert self.batch_size is not None
                # range first: a full batch pulls nothing past its last index
                idx = [int(i) for _, i in zip(range(self.batch_size), it, strict=False)]
                exhausted = len(idx) < self.batch_size
                if not idx or (self.drop_last and len(idx) < self.batch_size):
                    return
            if self.world_size > 1 and len(idx) < self.world_size:
                return  # too few to give every rank a sample, as unbroken.MapLoader
            yield idx, exhausted

    def _local_slice(self, global_idx: list[int]) -> list[int]:
        n, w, r = len(global_idx), self.world_size, self.rank
        return global_idx[r * n // w : (r + 1) * n // w]

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next: from its start, or on from the position if it is the
        epoch in progress."""
        if epoch != self.epoch:
            self.epoch, self.position, self._state = int(epoch), 0, None
            self._exhausted = False
        self._ended = False

    def __iter__(self) -> Iterator[Any]:
        if self._ended:
            self.epoch, self.position, self._state = self.epoch + 1, 0, None
            self._exhausted = False
        self._ended = False
        if self._exhausted:  # resumed after the epoch's last batch: the consumer sees the end
            self._ended = True
            return
        if self._state is not None:
            # Batches prefetched by an abandoned pass moved the sampler on: rewind it.
            self._source.load_state_dict(copy.deepcopy(self._state))
        elif callable(getattr(self._source, "set_epoch", None)):
            self._source.set_epoch(self.epoch)
        self._pending.clear()
        for batch in _workers.start(self._inner, self):
            global_idx, self._state, self._exhausted = self._pending.popleft()
            self._count(len(global_idx))
            self.last_indices = global_idx
            yield batch
        self._ended = True

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": SAMPLER_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "ended": self._ended,
            "exhausted": self._exhausted,
            "sampler": copy.deepcopy(self._state),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Store the position; the next ``iter()`` loads the sampler's state and continues."""
        if state_dict.get("version") != SAMPLER_VERSION:
            raise DataError(f"sampler loader state has version {state_dict.get('version')!r}")
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])
        self._ended = bool(state_dict.get("ended", False))
        self._exhausted = bool(state_dict.get("exhausted", False))
        self._state = copy.deepcopy(state_dict["sampler"])
