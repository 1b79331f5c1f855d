"""In-memory snapshots of a run (see unbroken/store/_snapshot.py for what they are).

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

from .. import _dist, _log, _stops
from .._shm import tell_run_dir
from ..store import CheckpointReader
from ..store._snapshot import SnapshotArea, SnapshotsOff

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


class Snapshots:
    def __init__(self, root: str | None, every: int | None, *, rank: int, run_dir: str) -> None:
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
            elif _dist.any_true(_dist.broadcast_object(root, what="snapshot area") != root):
                self._off_across_nodes(root)
        if self.area is not None:
            # At once, not at the first snapshot: a run that saves durably at every step takes
            # none, and the supervisor still judges a crash's progress by this directory.
            self.area.tell(run_dir)
        elif os.environ.get("LOCAL_RANK", "0") == "0":
            # No area (--no-snapshots, refused, off): the launch's stop directory is the channel.
            _stops.tell_run_dir(run_dir)

    def _off_across_nodes(self, root: str) -> None:
        """Ranks under several supervisors (one per node): a snapshot is one checkpoint of
        every rank, committed in one area, and ranks on other nodes cannot write into this
        node's memory. Off, said once per node; the supervisor still learns the run directory
        (a crash's progress is judged by its durable checkpoints)."""
        if os.environ.get("LOCAL_RANK", "0") == "0":
            tell_run_dir(root, self.run_dir)
            log.warning(
                "unbroken: in-memory snapshots are off: the ranks of this job are on %d nodes, "
                "each under its own supervisor, and one node's memory holds only its own ranks' "
                "part of a snapshot; a lost process or node costs the steps since the last "
                "durable save (save_every) -- see docs/supervise.md#several-nodes",
                _nodes(),
            )
        self.area = None

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
        return time.perf_counter() - t0

    def _fits(self, payload: Any) -> bool:
        assert self.area is not None
        nbytes = sum(t.numel() * t.element_size() for t in payload.tensors.values())
        ok = self.area.fits(nbytes) if self.rank == 0 else True
        ok = _dist.broadcast_object(ok)
        if not ok:
            if self.rank == 0:
                log.warning("unbroken: %s", self.area.disabled)
            self.area = None
        return bool(ok)

    def _choose_interval(self, step_s: float) -> int:
        cost = self.seconds or 0.0
        every = _dist.broadcast_object(interval_for(cost, step_s))
        if self.rank == 0:
            log.info(
                "unbroken: in-memory snapshot every %d step(s) (one takes %.1f ms, a step %.1f ms)",
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


def _nodes() -> int:
    """The job's node count as the launcher says it (torchrun: WORLD_SIZE / LOCAL_WORLD_SIZE)."""
    try:
        return max(2, int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError, ZeroDivisionError):
        return 2
