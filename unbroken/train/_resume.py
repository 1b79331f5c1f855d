"""Resuming a starting run: the choice carried out, and the chosen checkpoint restored.

Rank 0 lists what each tier holds (the run directory, the store of ``remote=``, the in-memory
snapshot area) and :func:`~._choice.choose` decides, from metadata only, which step the run
continues from -- never a fresh start over checkpoints none of which loads; starting over is an
explicit ``start_over=True``, which moves everything aside. Rank 0 carries the decision out
(moves aside, fetches or keeps the step in the run directory) and tells every rank, and every
rank loads it -- the saved stage's model built first, every component loaded, each rank
verifying the chunks it reads. A step that cannot be brought into the run directory, or whose
load fails its checksums on any rank, is marked unusable in the listings and the choice is made
again: one fallback loop, every rank loading the next choice over the partly written tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import _dist
from ..data._seeding import derive, seed_globals
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    StateError,
    UnsafeCheckpointError,
)
from ..process import _log
from ..state import Counters, Registry, _nested
from ..store import CheckpointReader, CheckpointStore, _layout
from ..store._entry import LOCAL, REMOTE, SNAPSHOT, Entry
from ..store._manifest import rank_file
from ._choice import Decision, Listings, choose
from ._config import RunConfig
from ._metrics import METRICS_FILE
from ._snapshots import Snapshots

if TYPE_CHECKING:
    from ..store.remote._tier import RemoteTier
    from ..store.snapshot._area import SnapshotArea

log = _log.get("run")
UNUSABLE = (CorruptCheckpointError, UnsafeCheckpointError, CheckpointNotFoundError)
"""What makes a step that another tier holds unusable when it is brought into the run directory
(a RemoteStoreError -- the store cannot be read -- is raised instead)."""


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
    _listings: Listings | None = field(default=None, init=False, repr=False)
    """Rank 0's: what the tiers hold, as verified and marked so far."""

    def resume(self) -> int | None:
        tries: dict[int, int] = {}
        while True:  # the one fallback loop: mark what failed, choose again
            step, again = self._choose()
            if again:
                continue  # the chosen step could not be brought into the run directory
            if step is None:
                if self.config.seed is not None:
                    seed_globals(derive(self.config.seed, self.rank))
                return None
            tries[step] = tries.get(step, 0) + 1
            failed = self._attempt(step)
            if not failed:
                return step
            # Any rank's load failed its checksums: every rank loads the next choice over it
            # (the live tensors were partly overwritten), so no rank trains on a state the
            # others do not share. A step that fails twice (a remote copy fetched again and
            # failing too) or an explicit resume=STEP is an error.
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
                assert self._listings is not None
                why = f"failed its checksums while loading ({said})"
                # What was read: the run directory's copy, or this node's snapshot of it.
                marked = self._listings.unusable(LOCAL, step, why)
                self._listings = marked.unusable(SNAPSHOT, step, why)

    def _choose(self) -> tuple[int | None, bool]:
        """Rank 0 chooses from metadata only and carries the choice out, then tells every
        rank: (the step, None for a fresh start; whether to choose again)."""
        outcome: tuple[int | None, bool, str | None, bool] = (None, False, None, False)
        if self.rank == 0:
            try:
                outcome = (*self._decide(), None, False)
            except Exception as e:
                if self.world_size == 1:
                    raise
                # Told to every rank, then raised.
                said = f"{type(e).__name__}: {e}"
                outcome = (None, False, said, isinstance(e, CorruptCheckpointError))
        step, again, error, corrupt = _dist.broadcast_object(outcome, what="resume choice")
        if error is not None:
            what = "choosing the checkpoint to resume from failed on rank 0"
            raise (CorruptCheckpointError if corrupt else ConfigError)(f"{what}: {error}")
        return step, again

    # ---- rank 0: the choice and carrying it out ---------------------------------------------

    def _area(self) -> SnapshotArea | None:
        """This node's snapshot area, when it holds whole snapshots (one node)."""
        area = self.snapshots.area if self.snapshots is not None else None
        return area if area is not None and area.layout is None else None

    def _list(self) -> Listings:
        """What each tier holds, nothing verified yet."""
        tier, area = self.remote(), self._area()
        return Listings(
            local=tuple(self.store.entries()),
            local_root=self.store.root,
            remote=None if tier is None else tuple(tier.remote.entries()),
            remote_root="" if tier is None else tier.remote.root,
            snapshot=() if area is None else tuple(area.entries()),
        )

    def _verify(self, listings: Listings, entry: Entry) -> Listings:
        """``entry`` verified from its metadata: the JSON files' checksums, the data files'
        sizes (their checksums are the loads', each rank the chunks it reads; an explicit
        ``resume=STEP`` checks every byte first)."""
        cfg = self.config
        if entry.tier == LOCAL:
            exact = cfg.resume is not True
            checked = self.store.verdict(entry, checksums=cfg.verify_checksums, data=exact)
            if checked is None:  # gone while read
                return listings.without(LOCAL, entry.step)
        elif entry.tier == REMOTE:
            tier = self.remote()
            assert tier is not None
            checked = tier.remote.verdict(entry)
        else:
            area = self._area()
            assert area is not None
            checked = area.verdict(entry, self.store.run_dir)
        return listings.replaced(checked)

    def _decide(self) -> tuple[int | None, bool]:
        """Choose, and carry the choice out: (step, again) -- ``again`` when the chosen step
        could not be brought into the run directory (marked unusable: choose again)."""
        cfg = self.config
        listings = self._listings if self._listings is not None else self._list()
        decision = choose(listings, resume=cfg.resume, start_over=cfg.start_over)
        while decision.check:  # verdicts it needs (not a fallback: nothing failed yet)
            for entry in decision.check:
                listings = self._verify(listings, entry)
            decision = choose(listings, resume=cfg.resume, start_over=cfg.start_over)
        self._listings = listings
        return self._carry_out(decision)

    def _carry_out(self, d: Decision) -> tuple[int | None, bool]:
        tier = self.remote()
        if d.abandon:
            if tier is not None and d.supersede:
                tier.remote.supersede_newer(-1)
            self.store.abandon(extra=[os.path.join(self.store.run_dir, METRICS_FILE)])
            return None, False
        for e in d.skipped:
            what = "remote checkpoint" if e.tier == REMOTE else "in-memory snapshot"
            _log.event(
                log,
                logging.WARNING,
                "unbroken: skipping unusable %s of step %d (%s): %s",
                what,
                e.step,
                e.where,
                e.why,
                step=e.step,
            )
        if d.step is None:
            return None, False
        step = d.step
        # Moved aside: the unusable local copy of the chosen step before another tier's copy
        # takes its place, the newer ones once it is in place.
        for e in d.set_aside:
            if e.step == step:
                self._set_aside(e)
        if d.source in (REMOTE, SNAPSHOT) and not self._bring(d):
            return None, True
        for e in d.set_aside:
            if e.step != step:
                self._set_aside(e)
        if any(e.tier == LOCAL for e in d.supersede):
            self.store.supersede_newer(step)
            for e in d.supersede:
                if e.tier == LOCAL:
                    self._drop(e)
        if tier is not None:
            if any(e.tier == REMOTE for e in d.supersede):
                tier.remote.supersede_newer(step)
            if d.source != REMOTE:
                tier.resumed(step, in_store=not d.upload)
        return step, False

    def _set_aside(self, e: Entry) -> None:
        self.store.set_aside(e.step, e.why)
        self._drop(e)

    def _drop(self, e: Entry) -> None:
        assert self._listings is not None
        self._listings = self._listings.without(e.tier, e.step)

    def _bring(self, d: Decision) -> bool:
        """Fetch (REMOTE) or commit (SNAPSHOT) step ``d.step`` into the run directory; False
        when it does not verify (it is marked unusable, and said)."""
        assert d.step is not None and self._listings is not None
        step, tier, area = d.step, self.remote(), self._area()
        try:
            if d.source == REMOTE:
                assert tier is not None
                tier.fetch(step)
            else:
                assert area is not None
                try:
                    kept = area.keep(step, self.store.run_dir)
                except (CheckpointError, OSError) as e:  # not kept: as when the supervisor
                    raise CorruptCheckpointError(str(e)) from e  # could not keep it either
                _log.event(
                    log,
                    logging.INFO,
                    "unbroken: the in-memory snapshot of step %d is newer than the checkpoints "
                    "(the supervisor did not keep it); committed it as %s",
                    step,
                    kept,
                    step=step,
                    path=kept,
                )
        except UNUSABLE as e:
            what = "remote checkpoint" if d.source == REMOTE else "in-memory snapshot"
            where = next(
                x.where for x in self._listings.all() if (x.tier, x.step) == (d.source, step)
            )
            _log.event(
                log,
                logging.WARNING,
                "unbroken: %s %s failed verification while %s: %s; trying an earlier one",
                what,
                where,
                "fetched" if d.source == REMOTE else "copied into the run directory",
                e,
                step=step,
                path=where,
            )
            assert d.source is not None
            self._listings = self._listings.unusable(d.source, step, str(e))
            return False
        # Verified as it was copied: the run directory's copy of the step.
        path = os.path.join(self.store.root, _layout.step_name(step))
        self._listings = self._listings.replaced(Entry(step, LOCAL, path, ok=True))
        return True

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


def saved_stage(trees: dict[str, Any]) -> Any:
    """The stage a checkpoint's counters name, read before anything is loaded."""
    counters = trees.get("counters")
    if not isinstance(counters, dict):
        return None
    return _nested.join(counters.get("stage"), {})
