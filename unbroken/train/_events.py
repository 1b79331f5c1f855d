"""What a run tells the world: log records (``unbroken.run``), the metrics log, the user's hooks.

Events: ``resume`` (INFO, and a line on stderr while logging is unconfigured: _log.announce),
``save`` (INFO, once durably committed), ``model_changed`` (INFO),
``extend`` (a complete run continued; WARNING), ``stop`` (WARNING: it must be seen with
logging unconfigured, through ``logging.lastResort``), and an error closing the run. The rank
policy is unbroken.process._log's: rank 0 speaks for the run.

The metrics log (``RUN/metrics.jsonl``, rank 0) gets one record per step and the run's events
(``resume``, ``stop``, ``model_changed``, ``audit``, ...); :class:`Events` owns it once opened.

Hooks (``RunConfig.on_save`` / ``on_resume``) are called with ``(step, path)`` in the training
thread; ``on_resume`` with the global random streams put back afterwards. A background save
commits in its own thread; its commit is queued and the hook called at the next ``step()``,
``wait()`` or ``close()`` -- never from the saving thread, which a user's logger (TensorBoard,
W&B, a file) need not be safe for.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..process import _log
from ..state import Counters, GlobalRNG
from ._metrics import MetricsLog

log = _log.get("run")

Hook = Callable[[int, str], Any]


class Events:
    def __init__(
        self,
        run_dir: str,
        counters: Counters,
        *,
        on_save: Hook | None = None,
        on_resume: Hook | None = None,
    ) -> None:
        self.dir, self.counters = run_dir, counters
        self.on_save, self.on_resume = on_save, on_resume
        self.metrics: MetricsLog | None = None
        self._committed: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    # ---- the metrics log -----------------------------------------------------------------------

    def open_metrics(
        self, offset: int | None, resumed_from: int | None, *, every_step: bool = False
    ) -> None:
        """Open ``metrics.jsonl`` cut to ``offset`` (what the resumed checkpoint recorded);
        ``every_step``: write each step's record as it ends, not in batches."""
        self.metrics = MetricsLog(self.dir, offset, resumed_from, every_step=every_step)

    def record(self, kind: str, **fields: Any) -> None:
        """An event of the current step in the metrics log (if this rank keeps one)."""
        if self.metrics is not None:
            self.metrics.event(kind, step=self.counters.step, **fields)

    def audit(self, check: str, **fields: Any) -> None:
        """What a start-up or loop-start check found (``unbroken verify`` ranks its hints by
        these)."""
        self.record("audit", check=check, **fields)

    def log_step(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.step(record)

    def metrics_offset(self, durable: bool) -> int:
        """The log's length for a checkpoint to record (fsynced first when ``durable``)."""
        if self.metrics is None:
            return 0
        return self.metrics.offset() if durable else self.metrics.length()

    # ---- log records and hooks -----------------------------------------------------------------

    def resumed(self, step: int, path: str) -> None:
        _log.announce(log, *resume_text(self.dir, step, path), step=step, path=path)
        self.record("resume")
        if self.on_resume is not None:
            # Only a resumed launch calls it: random numbers it draws (a tracker's run id, say)
            # must not shift the restored global streams away from the uninterrupted run's.
            streams = GlobalRNG()
            saved = streams.state_dict()
            try:
                self.on_resume(step, path)
            finally:
                streams.load_state_dict(saved)

    def committed(self, step: int, path: str, seconds: float | None = None) -> None:
        """A checkpoint is durable; any thread (the hook waits for :meth:`deliver`)."""
        took = f" in {seconds:.2f} s" if seconds is not None else ""
        _log.event(
            log, logging.INFO, "unbroken: saved step %d to %s%s", step, path, took,
            step=step, path=path,
        )  # fmt: skip
        if self.on_save is not None:
            with self._lock:
                self._committed.append((step, path))

    def deliver(self) -> None:
        """Call ``on_save`` for every commit since the last call (training thread)."""
        if self.on_save is None:
            return
        with self._lock:
            done, self._committed = self._committed, []
        for step, path in done:
            self.on_save(step, path)

    def stopped(self, reason: str, *, saved: bool = True) -> None:
        step = self.counters.step
        _log.event(
            log,
            logging.WARNING,
            "unbroken: stopped at step %d (%s); %s in %s; relaunch the same command to continue",
            step,
            reason,
            "checkpoint saved" if saved else "no step since the last save, nothing to save",
            self.dir,
            step=step,
            path=self.dir,
        )

    def extended(self, target: str) -> None:
        step = self.counters.step
        _log.event(
            log, logging.WARNING, "unbroken: %s was complete at step %d; continuing it to %s",
            self.dir, step, target, step=step, path=self.dir,
        )  # fmt: skip

    def model_changed(self, fields: dict[str, Any]) -> None:
        step = self.counters.step
        self.record("model_changed", **fields)
        if fields.get("reason") == "resume":
            return  # the resume's own record says which checkpoint
        _log.event(
            log, logging.INFO, "unbroken: model changed at step %d: %s", step, fields, step=step
        )

    def close_failed(self, error: BaseException) -> None:
        # Closing after an error must not hide that error: the close's own failure is logged.
        _log.event(
            log, logging.ERROR, "unbroken: closing the run after an error failed: %s", error,
            rank_local=True, path=self.dir,
        )  # fmt: skip

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def resume_text(run_dir: str, step: int, path: str) -> tuple[Any, ...]:
    """The resume line: which step, which checkpoint of which run directory."""
    where = os.path.relpath(path, run_dir) if path.startswith(run_dir + os.sep) else path
    return "unbroken: resumed %s from step %d (%s)", run_dir, step, where
