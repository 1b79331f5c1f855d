"""MapLoader: a resumable loader for map-style datasets (what torch calls a ``Dataset`` with
``__len__`` and ``__getitem__``).

The position is (epoch, samples consumed) in a global stream: epoch e's order is a permutation
fixed by (seed, e); a global batch takes the next B samples; rank r of W takes its slice. So
resuming is O(1) (no batch is replayed), the batch size may change at any step or between runs
without skipping or repeating a sample, and the world size may change between save and resume.

Randomness inside a sample comes from (seed, epoch, index), never from worker state:

* a dataset with ``get_sample(index, generator)`` is handed a ``torch.Generator`` seeded so;
* otherwise ``dataset[index]`` runs with the fetching process's global Python, NumPy and torch
  streams seeded so (in the main process they are put back afterwards, so the training
  stream -- dropout, say -- is not disturbed).

Either way augmentation is identical for any ``num_workers`` and any resume point. A
``collate_fn`` runs with the same global streams seeded from (seed, the batch's keys) and, in
the main process, put back (``_streams.BatchSeeder``): a collator that masks or crops at random
draws the same numbers in any process, and a batch fetched ahead of a save leaves the training
stream as it was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.data as tud

from ..errors import ConfigError, DataError
from . import _seeding, _workers
from ._contract import LoaderBase
from ._global_streams import BatchSeeder, KeyedBatch, SampleSeeder

LOADER_VERSION = 1


@dataclass(slots=True)
class _Plan:
    """One pass of the inner torch DataLoader: which batches it fetches, in order."""

    epoch: int
    start: int
    batch_size: int
    pending: deque[list[int]] = field(default_factory=deque)


class _Batches:
    """The batch sampler handed to torch's DataLoader; each pass follows the loader's plan."""

    def __init__(self, loader: MapLoader) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        plan = self._loader._plan
        assert plan is not None, "the loader sets a plan before iterating"
        return self._batches(plan)

    def _batches(self, plan: _Plan) -> Iterator[list[tuple[int, int]]]:
        loader = self._loader
        order = loader._order(plan.epoch)
        pos = plan.start
        while True:
            global_idx = loader._global_batch(order, pos, plan.batch_size)
            if global_idx is None:
                return
            pos += len(global_idx)
            plan.pending.append(global_idx)
            local = loader._local_slice(global_idx)
            yield [(plan.epoch, i) for i in local]

    def __len__(self) -> int:
        return self._loader.batches_per_epoch()


class _SeededFetch(tud.Dataset[Any]):
    """Wraps the user's dataset: keys are (epoch, index) and each sample is seeded from them.

    ``keyed``: a batch comes back as a :class:`KeyedBatch` (a list that knows its keys), for a
    :class:`BatchSeeder` collate to seed the global streams from.
    """

    def __init__(self, dataset: Any, seed: int, reseed_globals: Any, keyed: bool = False) -> None:
        self.dataset = dataset
        self.seed = seed
        self.seeder = SampleSeeder(seed, reseed_globals)
        self.protocol = callable(getattr(dataset, "get_sample", None))
        self.batched = callable(getattr(dataset, "__getitems__", None))
        self.keyed = keyed

    def _generated(self, key: tuple[int, int]) -> Any:
        g = torch.Generator()
        g.manual_seed(_seeding.sample_seed(self.seed, *key))
        return self.dataset.get_sample(key[1], g)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        items = self._fetch(keys)
        return KeyedBatch(items, keys) if self.keyed else items

    def _fetch(self, keys: Sequence[tuple[int, int]]) -> list[Any]:
        if self.protocol:
            return [self._generated(k) for k in keys]
        if not self.seeder.active:
            if self.batched:  # nothing to seed per sample: the dataset fetches its own way
                return list(self.dataset.__getitems__([i for _, i in keys]))
            return [self.dataset[i] for _, i in keys]
        return self.seeder.fetch(self.dataset.__getitem__, keys)

    def __len__(self) -> int:
        return len(self.dataset)


class MapLoader(LoaderBase):
    """Resumable loader over a map-style dataset; track it like any component.

    Not a drop-in ``torch.utils.data.DataLoader`` (hence its own name, docs/design.md): its
    ``batch_size`` is global, it shuffles by default, from ``seed``, and it takes no
    ``sampler``, ``batch_sampler`` or ``generator`` (the order is its own, and so is the
    position it saves; :class:`unbroken.data.SamplerLoader` reads a sampler of your own).
    The other arguments are torch's, keyword-only.

    ``batch_size`` is the *global* batch size (all ranks together) and may be changed at any
    time, e.g. by a schedule. ``rank``/``world_size`` default to torch.distributed's.
    ``reseed_globals``: which global random streams ``dataset[i]`` gets seeded from (seed,
    epoch, i) -- True (each of Python's, NumPy's and torch's that the dataset draws from,
    found by watching them), False, or some of ``"python"``, ``"numpy"``, ``"torch"``
    (seeded for every sample, watched or not); a dataset with ``get_sample(i, generator)``
    gets a generator instead. ``collate_fn`` runs with the streams ``reseed_globals`` names
    (True: all three) seeded from (seed, the batch's samples), put back in the main process.

    Example::

        loader = unbroken.MapLoader(dataset, batch_size=32, shuffle=True, seed=0, num_workers=2)
        run = unbroken.Run("runs/x", model=model, optimizer=opt, loader=loader)
        for epoch in run.epochs(10):
            for x, y in loader:
                ...
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
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
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(_unknown_arguments(unknown))
        if isinstance(dataset, tud.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError(
                "MapLoader needs a map-style dataset with __len__; for an iterable dataset "
                "use unbroken.IterableLoader"
            )
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._init_base(rank, world_size)
        self._plan: _Plan | None = None
        self._batch_size = 0
        self.batch_size = batch_size
        self.last_indices: list[int] = []
        """Global sample indices of the batch yielded last (every rank's slice)."""
        self._orders: dict[int, Any] = {}
        self._restart = False
        # True once a pass over the current epoch ran to its end here: only then does the next
        # iter() move on. A pass that starts on a finished epoch (just loaded or set_epoch'd)
        # yields nothing, so the consumer sees that epoch end exactly as an uninterrupted one did.
        self._ended = False
        # A collate_fn runs with the global streams seeded from its batch's keys (BatchSeeder).
        collate = BatchSeeder.wrap(collate_fn, self.seed, reseed_globals)
        self._inner = _workers.inner_loader(
            self,
            _SeededFetch(dataset, self.seed, reseed_globals, keyed=collate is not collate_fn),
            _Batches(self),
            seed=self.seed,
            num_workers=num_workers,
            collate_fn=collate,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
        )

    def close(self) -> None:
        """Shut down persistent worker processes (a later iteration starts new ones)."""
        _workers.shutdown(self._inner)

    # ---- configuration ------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        value = int(value)
        if value < 1:
            raise ConfigError(f"batch_size must be >= 1, got {value}")
        if value % self.world_size:
            raise ConfigError(
                f"global batch_size {value} is not divisible by world_size {self.world_size}"
            )
        if value != self._batch_size:
            # Batches already prefetched were cut for the old size: refetch from the position.
            self._restart = self._plan is not None
            self._batch_size = value

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next: from its start, or from the position if it is the epoch
        in progress (a finished one then yields nothing)."""
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0
            self._restart = self._plan is not None
        self._ended = False

    def __len__(self) -> int:
        return self.batches_per_epoch()

    def batches_per_epoch(self, batch_size: int | None = None) -> int:
        n, b = len(self.dataset), batch_size or self.batch_size
        return n // b if self.drop_last else -(-n // b)

    # ---- the stream ---------------------------------------------------------------------------

    def _order(self, epoch: int) -> Any:
        order = self._orders.get(epoch)
        if order is None:
            custom = getattr(self.dataset, "stream_order", None)
            if callable(custom):  # e.g. JsonlShards: shard order, then lines within each shard
                order = custom(self.seed, epoch, self.shuffle)
            else:
                order = _seeding.epoch_order(self.seed, epoch, len(self.dataset), self.shuffle)
            self._orders = {epoch: order}  # one epoch cached: O(dataset) memory, not O(epochs)
        return order

    def _global_batch(self, order: Any, pos: int, batch_size: int) -> list[int] | None:
        remaining = len(order) - pos
        if remaining <= 0 or (self.drop_last and remaining < batch_size):
            return None
        if self.world_size > 1 and remaining < self.world_size:
            return None  # too few left to give every rank a sample; documented
        return order[pos : pos + batch_size].tolist()

    def _local_slice(self, global_idx: list[int]) -> list[int]:
        if self.world_size == 1:
            return global_idx
        n, w, r = len(global_idx), self.world_size, self.rank
        lo = r * n // w
        hi = (r + 1) * n // w
        return global_idx[lo:hi]

    def epoch_finished(self) -> bool:
        remaining = len(self.dataset) - self.position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            return True
        return self.world_size > 1 and remaining < self.world_size

    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch (the next one if a pass here finished it)."""
        if self._ended and self.epoch_finished():
            self.epoch, self.position = self.epoch + 1, 0
        self._ended = False
        while True:
            self._restart = False
            plan = _Plan(self.epoch, self.position, self.batch_size)
            self._plan = plan
            try:
                for batch in _workers.start(self._inner, self):
                    global_idx = plan.pending.popleft()
                    self._count(len(global_idx))
                    self.last_indices = global_idx
                    yield batch
                    if self._restart:
                        break
                else:
                    self._ended = True
                    return
            finally:
                if self._plan is plan:  # an abandoned older iterator must not clear a newer plan
                    self._plan = None

    # ---- Stateful -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        source = getattr(self.dataset, "source_state", None)
        extra = {"source": source()} if callable(source) else {}
        return {
            **extra,
            "version": LOADER_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),
            "batch_size": self.batch_size,
            "ended": self._ended,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Store the position; the next ``iter()`` continues from it (deferred restore)."""
        if state_dict.get("version") != LOADER_VERSION:
            raise DataError(f"loader state has version {state_dict.get('version')!r}")
        check = getattr(self.dataset, "check_source_state", None)
        if callable(check) and "source" in state_dict:
            check(state_dict["source"])  # names the shard that changed, before dataset_len does
        for key, now in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("dataset_len", len(self.dataset)),
        ):
            if state_dict[key] != now:
                raise DataError(
                    f"loader: {key} was {state_dict[key]!r} when saved but is {now!r} now, so "
                    "the saved position would point at other samples; use the same dataset "
                    f"and {key}, or start the stream fresh under a new component name "
                    "(Run(..., allow_missing=[new], allow_unexpected=[old]))"
                )
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])
        self._ended = bool(state_dict.get("ended", False))
        self._restart = self._plan is not None


def _unknown_arguments(unknown: dict[str, Any]) -> str:
    """What to do instead of a torch DataLoader argument MapLoader does not take."""
    names = ", ".join(sorted(unknown))
    text = f"MapLoader got argument(s) it does not take: {names}."
    if {"sampler", "batch_sampler"} & set(unknown):
        text += (
            " MapLoader draws its own order from (seed, epoch), which is what lets it resume "
            "mid-epoch on any world size; for a sampler of your own use "
            "unbroken.data.SamplerLoader(dataset, sampler=..., batch_size=...)."
        )
    if "generator" in unknown:
        text += " The shuffle is seeded by seed=...: pass seed instead of a generator."
    return text + " Its arguments: docs/api.md (MapLoader)."
