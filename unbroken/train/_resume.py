"""Which checkpoint a starting run resumes from -- and what it refuses to do instead.

A run directory whose checkpoints none of which loads is an error, never a fresh start (a
reader that cannot read what an older version wrote must not let retention delete it);
starting over is an explicit ``start_over=True``, which moves everything aside. Then how the
chosen checkpoint is restored: the saved stage's model built first, every component loaded,
and -- in one process -- the previous checkpoint loaded over a load that failed its checksums.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _dist, _log
from .._errors import ConfigError, CorruptCheckpointError, StateError
from ..data._seeding import derive, seed_globals
from ..state import Counters, Registry
from ..store import CheckpointReader, CheckpointStore
from ..store._manifest import rank_file
from ._config import RunConfig
from ._metrics import METRICS_FILE
from ._snapshots import Snapshots
from ._tree_peek import saved_stage

if TYPE_CHECKING:
    from ..store._tier import RemoteTier

log = _log.get("run")


@dataclass
class Resumer:
    """Chooses the checkpoint a starting run continues from and loads it into the components.

    Call order: :meth:`resume` once, on every rank, after the run directory is locked (rank 0)
    and before training; it returns the step resumed from (None: a fresh start, streams seeded
    from ``config.seed`` if given).
    """

    store: CheckpointStore
    config: RunConfig
    registry: Registry
    counters: Counters
    rank: int
    world_size: int
    snapshots: Snapshots | None
    swap_model: Callable[[Any, str], Any]
    """``swap_model(new_model, reason)``: how a resume into another stage replaces the model."""
    remote: Callable[[], RemoteTier | None] = lambda: None
    """Rank 0's remote tier (``remote=``), made on first call: the newest step that verifies in
    either tier wins."""
    extended_to: str | None = None
    """Set when the checkpoint was of a complete run that ``max_steps`` now extends."""

    def resume(self) -> int | None:
        reader = self._choose()
        if reader is None:
            if self.config.seed is not None:
                seed_globals(derive(self.config.seed, self.rank))
            return None
        return self._restore_or_fall_back(reader)

    def _choose(self) -> CheckpointReader | None:
        """Rank 0 picks (and verifies) the checkpoint; every rank opens the same step."""
        choice: tuple[int | None, str | None] = (None, None)
        if self.rank == 0:
            try:
                choice = (self._pick(), None)
            except Exception as e:
                if self.world_size == 1:
                    raise
                choice = (None, f"{type(e).__name__}: {e}")  # told to every rank, then raised
        step, error = _dist.broadcast_object(choice, what="resume choice")
        if error is not None:
            raise ConfigError(f"choosing the checkpoint to resume from failed on rank 0: {error}")
        if step is None:
            return None
        return self.store.open(step, checksums=False)

    def _pick(self, one_pass: bool = True) -> int | None:
        # In one process the data files' checksums are verified while the load reads them (one
        # pass over the disk); rank 0 of several verifies everything first, since the other ranks
        # load what it chose.
        data = not (one_pass and self.world_size == 1)
        metrics = os.path.join(self.store.run_dir, METRICS_FILE)
        return pick_step(self.store, self.config, metrics, data, remote=self.remote())

    def _restore_or_fall_back(self, reader: CheckpointReader) -> int:
        """Restore ``reader``; if its data fails the checksums while loading (one process),
        load the next checkpoint that verifies over it."""
        try:
            return self._restore(reader)
        except CorruptCheckpointError as e:
            if self.world_size > 1 or self.config.resume is not True:
                raise
            _log.event(
                log,
                logging.WARNING,
                "unbroken: checkpoint %s failed its checksums while loading: %s; loading an "
                "earlier one over it",
                reader.path,
                e,
                step=reader.step,
                path=reader.path,
            )
        # The live tensors were partly overwritten: the next checkpoint that verifies (this time
        # every byte, before loading; the bad one is moved aside as unusable) is loaded over all.
        step = self._pick(one_pass=False)
        if step is None:
            raise CorruptCheckpointError(f"no checkpoint in {self.store.root} loads")
        return self._restore(self.store.open(step, checksums=False))

    def _restore(self, reader: CheckpointReader) -> int:
        """Load ``reader`` into every component (the model of the saved stage first)."""
        rank, registry, counters = self.rank, self.registry, self.counters
        trees = reader.global_trees()
        local = reader.local_trees(rank)
        allow_missing = set(self.config.allow_missing)
        if local is None and rank < reader.world_size:
            raise CorruptCheckpointError(
                f"checkpoint {reader.path} was saved by {reader.world_size} ranks but holds no "
                f"state of rank {rank} ({rank_file(rank)})"
            )
        if local is None:
            # A rank that did not exist when this was saved (resume on more ranks): its
            # rank-local streams start from a seed derived from (step, rank); documented.
            allow_missing |= {c.name for c in registry if c.rank_local}
            seed_globals(derive(reader.step, rank, domain=b"new-rank"))
            _log.event(
                log,
                logging.WARNING,
                "unbroken: rank %d did not exist when step %d was saved (world size %d); its "
                "random streams are seeded from (step, rank)",
                rank,
                reader.step,
                reader.world_size,
                rank_local=True,
                step=reader.step,
                path=reader.path,
            )
        else:
            trees = {**trees, **local}
        stage = saved_stage(trees)
        if stage != counters.stage:
            # Build the model of the saved stage before loading anything into it.
            if self.config.model_factory is None:
                raise StateError(
                    f"checkpoint {reader.path} is at stage {stage!r} but the model was built "
                    f"for stage {counters.stage!r} and Run has no model_factory to build "
                    "the saved stage; pass model_factory=build(stage)"
                )
            self.swap_model(self.config.model_factory(stage), "resume")
        names = registry.check_names(
            trees,
            allow_missing=allow_missing,
            allow_unexpected=self.config.allow_unexpected,
            where=f"checkpoint {reader.path}",
        )
        targets = registry.plan(names, trees, reader.tensor_infos())
        # The same checkpoint from this node's shared memory, if a supervisor kept it there.
        source = self.snapshots.source_for(reader) if self.snapshots is not None else reader
        source.load_tensors(targets)
        registry.restore(names, trees, targets)
        m = self.config.max_steps
        if counters.complete and m is not None and counters.step < m:
            counters.complete = False  # a finished run asked for more: it continues, and says so
            self.extended_to = f"max_steps={m}"
        return reader.step


def pick_step(
    store: CheckpointStore,
    config: RunConfig,
    metrics_path: str,
    data: bool = True,
    remote: RemoteTier | None = None,
) -> int | None:
    """The step to resume from (None: a fresh start); rank 0 only, holding the lock.
    ``data=False``: format-2 data files are verified by the load instead (one pass).
    ``remote``: the newest step that verifies in either tier (store/_tier.py)."""
    want = config.resume
    if config.start_over:
        if remote is not None:
            remote.refuse_fresh_start(start_over=True)
        store.abandon(extra=[metrics_path])
        return None
    if want is False:
        if store.listing(checksums=False):
            raise ConfigError(
                f"resume=False but {store.root} already holds checkpoints; use another run "
                "directory, resume=True, or start_over=True (moves them aside)"
            )
        if remote is not None:
            remote.refuse_fresh_start(start_over=False)
        return None
    if remote is not None:
        return remote.resume_step(want, checksums=config.verify_checksums, data=data)
    if want is True:
        # Raises when checkpoints exist and none loads: never a fresh start over them.
        latest = store.latest(checksums=config.verify_checksums, data=data)
        if latest is None:
            return None
        # Newer ones were unusable: move them aside, so that neither saving their step again
        # nor retention destroys them.
        store.supersede_newer(latest.step, unusable=True)
        return latest.step
    step = store.open(int(want), checksums=config.verify_checksums).step
    store.supersede_newer(step)
    return step
