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
from typing import Any

from .. import _dist, _log
from .._errors import ConfigError, CorruptCheckpointError, StateError
from ..data._seeding import derive, seed_globals
from ..store import CheckpointReader, CheckpointStore
from ..store._manifest import rank_file
from ._config import RunConfig
from ._metrics import METRICS_FILE
from ._tree_peek import saved_stage

log = _log.get("run")


def choose_checkpoint(run: Any) -> CheckpointReader | None:
    """Rank 0 picks (and verifies) the checkpoint; every rank opens the same step."""
    choice: tuple[int | None, str | None] = (None, None)
    if run.rank == 0:
        try:
            choice = (_pick(run), None)
        except Exception as e:
            if run.world_size == 1:
                raise
            choice = (None, f"{type(e).__name__}: {e}")  # told to every rank, then raised
    step, error = _dist.broadcast_object(choice, what="resume choice")
    if error is not None:
        raise ConfigError(f"choosing the checkpoint to resume from failed on rank 0: {error}")
    if step is None:
        return None
    return run.store.open(step, checksums=False)


def _pick(run: Any, one_pass: bool = True) -> int | None:
    # In one process the data files' checksums are verified while the load reads them (one
    # pass over the disk); rank 0 of several verifies everything first, since the other ranks
    # load what it chose.
    data = not (one_pass and run.world_size == 1)
    return pick_step(run.store, run.config, os.path.join(run.dir, METRICS_FILE), data)


def restore_or_fall_back(run: Any, reader: CheckpointReader) -> None:
    """``run._restore(reader)``; if its data fails the checksums while loading (one process),
    load the next checkpoint that verifies over it."""
    try:
        run._restore(reader)
        return
    except CorruptCheckpointError as e:
        if run.world_size > 1 or run.config.resume is not True:
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
    step = _pick(run, one_pass=False)
    if step is None:
        raise CorruptCheckpointError(f"no checkpoint in {run.store.root} loads")
    run._restore(run.store.open(step, checksums=False))


def pick_step(
    store: CheckpointStore, config: RunConfig, metrics_path: str, data: bool = True
) -> int | None:
    """The step to resume from (None: a fresh start); rank 0 only, holding the lock.
    ``data=False``: format-2 data files are verified by the load instead (one pass)."""
    want = config.resume
    if config.start_over:
        store.abandon(extra=[metrics_path])
        return None
    if want is False:
        if store.listing(checksums=False):
            raise ConfigError(
                f"resume=False but {store.root} already holds checkpoints; use another run "
                "directory, resume=True, or start_over=True (moves them aside)"
            )
        return None
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


def restore(run: Any, reader: CheckpointReader) -> None:
    """Load ``reader`` into every component of ``run`` (the model of the saved stage first)."""
    trees = reader.global_trees()
    local = reader.local_trees(run.rank)
    allow_missing = set(run.config.allow_missing)
    if local is None and run.rank < reader.world_size:
        raise CorruptCheckpointError(
            f"checkpoint {reader.path} was saved by {reader.world_size} ranks but holds no "
            f"state of rank {run.rank} ({rank_file(run.rank)})"
        )
    if local is None:
        # A rank that did not exist when this was saved (resume on more ranks): its
        # rank-local streams start from a seed derived from (step, rank); documented.
        allow_missing |= {c.name for c in run.registry if c.rank_local}
        seed_globals(derive(reader.step, run.rank, domain=b"new-rank"))
        _log.event(
            log,
            logging.WARNING,
            "unbroken: rank %d did not exist when step %d was saved (world size %d); its "
            "random streams are seeded from (step, rank)",
            run.rank,
            reader.step,
            reader.world_size,
            rank_local=True,
            step=reader.step,
            path=reader.path,
        )
    else:
        trees = {**trees, **local}
    stage = saved_stage(trees)
    if stage != run.counters.stage:
        # Build the model of the saved stage before loading anything into it.
        if run.config.model_factory is None:
            raise StateError(
                f"checkpoint {reader.path} is at stage {stage!r} but the model was built "
                f"for stage {run.counters.stage!r} and Run has no model_factory to build "
                "the saved stage; pass model_factory=build(stage)"
            )
        run._stepper.swap_model(run.config.model_factory(stage), reason="resume")
    names = run.registry.check_names(
        trees,
        allow_missing=allow_missing,
        allow_unexpected=run.config.allow_unexpected,
        where=f"checkpoint {reader.path}",
    )
    targets = run.registry.plan(names, trees, reader.tensor_infos())
    # The same checkpoint from this node's shared memory, if a supervisor kept it there.
    run._snapshots.source_for(reader).load_tensors(targets)
    run.registry.restore(names, trees, targets)
    run.resumed_from = reader.step
    m = run.config.max_steps
    if run.counters.complete and m is not None and run.counters.step < m:
        run._extend(f"max_steps={m}")
