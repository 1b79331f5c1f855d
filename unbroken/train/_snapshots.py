"""The Run's in-memory snapshots (see unbroken/store/_snapshot.py for what they are).

Active only when the supervisor set ``UNBROKEN_SNAPSHOT_DIR`` (``unbroken run``) and
``snapshot_every`` is not 0. ``snapshot_every=None`` (the default) picks the interval from the
first snapshot's cost: as often as keeps snapshots at <= 2% of the step time, every step when
that allows it. Every rank takes part in every snapshot (the store's save is collective), so
the interval is decided on rank 0 and broadcast once.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from .. import _dist
from ..store._snapshot import ENV, SnapshotArea

log = logging.getLogger("unbroken")
BUDGET = 0.02
"""Snapshots may cost this fraction of the training time (issue 16)."""


def interval_for(cost_s: float, step_s: float) -> int:
    """Snapshot every this many steps: every step when one costs at most ``BUDGET`` of a step,
    else as often as keeps their cost within it."""
    if cost_s <= BUDGET * step_s:
        return 1
    return math.ceil(cost_s / (BUDGET * max(step_s, 1e-6)))


class Snapshots:
    def __init__(self, run: Any, every: int | None) -> None:
        self.run = run
        root = os.environ.get(ENV)
        self.area: SnapshotArea | None = None
        self.interval = every
        self.seconds: float | None = None
        self.taken = 0
        if root and every != 0:
            self.area = SnapshotArea(root, clean=run.rank == 0)
            _dist.barrier()  # rank 0 cleaned a killed snapshot's leftovers first

    @property
    def active(self) -> bool:
        return self.area is not None

    def after_step(self, step: int, saved: bool) -> None:
        """Called by every rank at the end of each step (after any durable save)."""
        if self.area is None or saved:
            return  # a durable checkpoint of this step already exists
        if self.interval is not None and step % self.interval:
            return
        t0 = time.perf_counter()
        run, c = self.run, self.run.counters
        if run._metrics is not None:
            c.metrics_offset = run._metrics.length()
        payload = run.registry.collect(run.rank)
        if self.taken == 0 and not self._fits(payload):
            return
        self._take(step, payload)
        self.seconds = time.perf_counter() - t0
        self.taken += 1
        if self.interval is None:
            self.interval = self._choose_interval()
        # The snapshot is not training time.
        self.run._last_tick += time.perf_counter() - t0

    def _fits(self, payload: Any) -> bool:
        assert self.area is not None
        nbytes = sum(t.numel() * t.element_size() for t in payload.tensors.values())
        ok = self.area.fits(nbytes) if self.run.rank == 0 else True
        ok = _dist.broadcast_object(ok)
        if not ok:
            if self.run.rank == 0:
                log.warning("unbroken: %s", self.area.disabled)
            self.area = None
        return ok

    def _take(self, step: int, payload: Any) -> None:
        run, c = self.run, self.run.counters
        meta = {
            "epoch": c.epoch,
            "samples": c.samples,
            "stage": c.stage,
            "run_dir": run.dir,
            "snapshot": True,
        }
        if run._metrics is not None:
            meta["metrics_bytes"] = c.metrics_offset
        assert self.area is not None
        self.area.save(step, payload, meta)

    def _choose_interval(self) -> int:
        step_s = self.run._step_seconds or 0.0
        cost = self.seconds or 0.0
        every = _dist.broadcast_object(interval_for(cost, step_s))
        if self.run.rank == 0:
            log.info(
                "unbroken: in-memory snapshot every %d step(s) (one takes %.1f ms, a step %.1f ms)",
                every,
                cost * 1e3,
                step_s * 1e3,
            )
        return int(every)

    def source_for(self, reader: Any) -> Any:
        """The snapshot holding ``reader``'s very checkpoint, if this node has it: its tensors
        are read from memory instead of the disk."""
        if self.area is None:
            return reader
        snap = self.area.matching(reader)
        if snap is None:
            return reader
        log.info("unbroken: reading step %d from the in-memory snapshot", reader.step)
        return snap
