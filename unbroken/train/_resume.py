"""Which checkpoint a starting run resumes from -- and what it refuses to do instead.

A run directory whose checkpoints none of which loads is an error, never a fresh start (a
reader that cannot read what an older version wrote must not let retention delete it);
starting over is an explicit ``start_over=True``, which moves everything aside. Then how the
chosen checkpoint is restored: the saved stage's model built first, every component loaded,
and the previous checkpoint loaded over a load that failed its checksums on any rank.
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
from ..store import CheckpointReader, CheckpointStore, _layout
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
        step = self._choose()
        if step is None:
            if self.config.seed is not None:
                seed_globals(derive(self.config.seed, self.rank))
            return None
        return self._load_or_fall_back(step)

    def _choose(self, unusable: int | None = None) -> int | None:
        """Rank 0 picks the step from metadata only (manifests, tables, the small files'
        checksums) and tells every rank; ``unusable``: a step that failed to load, moved
        aside first."""
        choice: tuple[int | None, str | None, bool] = (None, None, False)
        if self.rank == 0:
            try:
                if unusable is not None:
                    self.store.set_aside(unusable, "failed its checksums while loading")
                # Data files are verified by the loads, each rank the chunks it reads.
                metrics = os.path.join(self.store.run_dir, METRICS_FILE)
                choice = (
                    pick_step(self.store, self.config, metrics, False, self.remote()),
                    None,
                    False,
                )
            except Exception as e:
                if self.world_size == 1:
                    raise
                # Told to every rank, then raised.
                choice = (None, f"{type(e).__name__}: {e}", isinstance(e, CorruptCheckpointError))
        step, error, corrupt = _dist.broadcast_object(choice, what="resume choice")
        if error is not None:
            what = "choosing the checkpoint to resume from failed on rank 0"
            raise (CorruptCheckpointError if corrupt else ConfigError)(f"{what}: {error}")
        return step

    def _load_or_fall_back(self, step: int) -> int:
        """Load ``step`` on every rank, each verifying the chunks it reads; if any rank's load
        fails its checksums, every rank loads the newest earlier checkpoint that loads over
        it (the bad one moved aside), so no rank trains on a state the others do not share."""
        tries: dict[int, int] = {}
        while True:
            tries[step] = tries.get(step, 0) + 1
            failed = self._attempt(step)
            if not failed:
                return step
            path = os.path.join(self.store.root, _layout.step_name(step))
            said = _by_reason(failed)
            if self.config.resume is not True or tries[step] > 1:
                raise CorruptCheckpointError(
                    f"checkpoint {path} failed its checksums while loading ({said})", path=path
                )
            if self.rank == 0:
                _log.event(
                    log,
                    logging.WARNING,
                    "unbroken: checkpoint %s failed its checksums while loading (%s); every "
                    "rank loads an earlier one over it",
                    path,
                    said,
                    step=step,
                    path=path,
                )
            # The live tensors were partly overwritten: the next checkpoint is loaded over all.
            nxt = self._choose(unusable=step)
            if nxt is None:
                raise CorruptCheckpointError(f"no checkpoint in {self.store.root} loads")
            step = nxt

    def _attempt(self, step: int) -> list[tuple[int, str]]:
        """Restore ``step`` on this rank; returns every rank's checksum failure (rank, why),
        agreed by one collective before the load and one after it. Any other error is
        raised on every rank (by the rank that hit it, the others naming it)."""
        error: BaseException | None = None
        loaded: Callable[[], None] | None = None
        try:
            loaded = self._prepare(self.store.open(step, checksums=False))
        except Exception as e:
            error = e
        failed = self._agree(error, "resume plan agreement")
        if failed or loaded is None:
            return failed
        try:
            loaded()
        except Exception as e:
            error = e
        return self._agree(error, "resume load agreement")

    def _agree(self, error: BaseException | None, what: str) -> list[tuple[int, str]]:
        # One bounded collective when every rank succeeded; the reasons only on a failure.
        if not _dist.any_true(error is not None, what=what):
            return []
        mine = None if error is None else (str(error), isinstance(error, CorruptCheckpointError))
        every = _dist.all_gather_object(mine)
        other = [(r, v[0]) for r, v in enumerate(every) if v is not None and not v[1]]
        if error is not None and not isinstance(error, CorruptCheckpointError):
            raise error
        if other:
            r, why = other[0]
            raise StateError(f"rank {r} failed to resume, so this rank stops too: {why}")
        return [(r, v[0]) for r, v in enumerate(every) if v is not None]

    def _prepare(self, reader: CheckpointReader) -> Callable[[], None]:
        """Check ``reader`` against the components and plan the load (the model of the saved
        stage built first); returns the load itself, which reads and verifies the tensors."""
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

        def load() -> None:
            source.load_tensors(targets)
            registry.restore(names, trees, targets)
            m = self.config.max_steps
            if counters.complete and m is not None and counters.step < m:
                counters.complete = False  # a finished run asked for more: it continues, says so
                self.extended_to = f"max_steps={m}"

        return load


def _by_reason(failed: list[tuple[int, str]]) -> str:
    """``rank 1: why`` -- ranks that report the same failure (a collective load hands every
    rank the first error of any) named together."""
    ranks: dict[str, list[int]] = {}
    for r, why in failed:
        ranks.setdefault(why, []).append(r)
    return "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {why}"
        for why, rs in ranks.items()
    )


def pick_step(
    store: CheckpointStore,
    config: RunConfig,
    metrics_path: str,
    data: bool = True,
    remote: RemoteTier | None = None,
) -> int | None:
    """The step to resume from (None: a fresh start); rank 0 only, holding the lock.
    ``data=False``: format-2 data files are verified by the loads instead (one pass, each rank
    the chunks it reads), so that picking reads metadata only.
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
