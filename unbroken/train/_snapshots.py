"""In-memory snapshots of a run (see unbroken/store/snapshot/_area.py for what they are).

Active only under ``unbroken run`` (which hands the trainer a snapshot area through the process
protocol) and when ``snapshot_every`` is not 0. ``snapshot_every=None`` (the default) picks the
interval from the first snapshot's cost: as often as keeps snapshots at <= 2% of the step time,
every step when that allows it. Every rank takes part in every snapshot (the store's save is
collective), so the interval is decided on rank 0 and broadcast once.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from .. import _dist
from ..process import _log, _stops
from ..store import CheckpointReader
from ..store.snapshot._area import SnapshotArea, SnapshotsOff
from ..store.snapshot._nodes import NodeLayout

log = _log.get()
BUDGET = 0.02
"""Snapshots may cost this fraction of the training time."""

Collect = Callable[[], tuple[Any, dict[str, Any]]]
"""Returns (payload, meta) of the state as it is now: what a checkpoint of this step holds."""


def interval_for(cost_s: float, step_s: float) -> int:
    """Snapshot every this many steps: every step when one costs at most ``BUDGET`` of a step,
    else as often as keeps their cost within it."""
    if cost_s <= BUDGET * step_s:
        return 1
    return math.ceil(cost_s / (BUDGET * max(step_s, 1e-6)))


def say_nodes(nodes: int) -> None:
    """Said at start-up by each node's first rank (a decision, on stderr)."""
    _log.say(
        log,
        "in-memory snapshots across %d nodes: each node keeps its ranks' part and a copy of the "
        "previous node's (at most one lost node loses at most one step)",
        nodes,
    )


class Snapshots:
    def __init__(
        self,
        root: str | None,
        every: int | None,
        *,
        rank: int,
        run_dir: str,
        schedule: dict[str, int | None] | None = None,
    ) -> None:
        self.rank, self.run_dir = rank, run_dir
        self.area: SnapshotArea | None = None
        self.interval = every
        self.seconds: float | None = None
        self.taken = 0
        if root and every != 0:
            try:
                self.area = SnapshotArea(root, clean=rank == 0)
            except SnapshotsOff as e:  # not a private area (another user's, a link, ...)
                log.warning("unbroken: in-memory snapshots are off: %s", e)
            # Every rank or none (a snapshot is collective); also: rank 0 cleaned first.
            if _dist.any_true(self.area is None):
                self.area = None
            elif _dist.active():
                self._spread(root)
        if self.area is not None:
            # At once, not at the first snapshot: a run that saves durably at every step takes
            # none, and the supervisor still judges a crash's progress by this directory.
            self.area.tell(run_dir)
        elif os.environ.get("LOCAL_RANK", "0") == "0":
            # No area (--no-snapshots, refused, off): the launch's stop directory is the channel.
            _stops.tell_run_dir(run_dir, schedule)

    def _spread(self, root: str) -> None:
        """Ranks under several supervisors (one per node, each with its own area): each node
        commits its part of every snapshot, with a copy of the previous node's part, so any
        one node can be lost (store/snapshot/_nodes.py)."""
        assert self.area is not None
        layout = NodeLayout.of(_dist.all_gather_json(root, what="snapshot areas"), self.rank)
        if layout is None:
            return  # one area: whole snapshots, as in one process
        if layout.leader and self.rank != 0:
            self.area.store.clean_stale()  # rank 0 cleaned its own node's area at its creation
        # Collective on every rank; gloo whatever the training's backend: the copies are of
        # host memory (the snapshot's files).
        self.area.across_nodes(layout, _dist.new_cpu_group())
        if layout.leader:
            say_nodes(layout.nodes)

    @property
    def active(self) -> bool:
        return self.area is not None

    def after_step(
        self, step: int, saved: bool, collect: Collect, step_seconds: float | None
    ) -> float:
        """Called by every rank at the end of each step (after any durable save); returns the
        seconds it took (not training time)."""
        if self.area is None or saved:
            return 0.0  # a durable checkpoint of this step already exists
        if self.interval is not None and step % self.interval:
            return 0.0
        t0 = time.perf_counter()
        payload, meta = collect()
        if self.taken == 0 and not self._fits(payload):
            return time.perf_counter() - t0
        if (
            self.area.save(step, payload, {**meta, "run_dir": self.run_dir, "snapshot": True})
            is None
        ):
            self.area = None  # memory ran out: said, and off on every rank (the store agreed)
            return time.perf_counter() - t0
        self.seconds = time.perf_counter() - t0
        self.taken += 1
        if self.interval is None:
            self.interval = self._choose_interval(step_seconds or 0.0)
        elif self.taken == 1 and self.rank == 0:
            _log.say(log, "in-memory snapshot every %d step(s) (snapshot_every)", self.interval)
        return time.perf_counter() - t0

    def _fits(self, payload: Any) -> bool:
        assert self.area is not None
        nbytes = sum(t.numel() * t.element_size() for t in payload.tensors.values())
        layout = self.area.layout
        if layout is None:
            ok = self.area.fits(nbytes) if self.rank == 0 else True
            ok = _dist.broadcast_object(ok)
        else:  # each node's own memory, for its ranks' part and the copy (about as large)
            ok = self.area.fits(2 * nbytes) if layout.leader else True
            ok = not _dist.any_true(not ok, what="snapshot memory")
        if not ok:
            if self.area.disabled is not None:
                log.warning("unbroken: %s", self.area.disabled)
            self.area = None
        return bool(ok)

    def _choose_interval(self, step_s: float) -> int:
        cost = self.seconds or 0.0
        every = _dist.broadcast_object(interval_for(cost, step_s))
        if self.rank == 0:
            _log.say(
                log,
                "in-memory snapshot every %d step(s): one takes %.1f ms, a step %.1f ms (at most "
                "2%% of the step time; snapshot_every in Run to choose)",
                every,
                cost * 1e3,
                step_s * 1e3,
            )
        return int(every)

    def source_for(self, reader: CheckpointReader) -> Any:
        """The snapshot holding ``reader``'s very checkpoint, if this node has it: its tensors
        are read from memory instead of the disk."""
        if self.area is None:
            return reader
        snap = self.area.matching(reader)
        if snap is None:
            return reader
        log.info("unbroken: reading step %d from the in-memory snapshot", reader.step)
        return snap
