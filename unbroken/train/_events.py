"""What a run tells the world: log records (``unbroken.run``) and the user's hooks.

Events: ``resume`` (INFO, and a line on stderr while logging is unconfigured: _log.announce),
``save`` (INFO, once durably committed), ``model_changed`` (INFO),
``extend`` (a complete run continued; WARNING), ``stop`` (WARNING: it must be seen with
logging unconfigured, through ``logging.lastResort``), and an error closing the run. The rank
policy is unbroken._log's: rank 0 speaks for the run.

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
from typing import Any

from .. import _log
from ..state import GlobalRNG

log = _log.get("run")


class Events:
    def __init__(self, run: Any) -> None:
        self.run = run
        self._committed: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    # ---- called by Run -------------------------------------------------------------------------

    def resumed(self, step: int, path: str) -> None:
        run = self.run
        _log.announce(log, *resume_text(run.dir, step, path), step=step, path=path)
        if run.config.on_resume is not None:
            # Only a resumed launch calls it: random numbers it draws (a tracker's run id, say)
            # must not shift the restored global streams away from the uninterrupted run's.
            streams = GlobalRNG()
            saved = streams.state_dict()
            try:
                run.config.on_resume(step, path)
            finally:
                streams.load_state_dict(saved)

    def committed(self, step: int, path: str, seconds: float | None = None) -> None:
        """A checkpoint is durable; any thread (the hook waits for :meth:`deliver`)."""
        took = f" in {seconds:.2f} s" if seconds is not None else ""
        _log.event(
            log, logging.INFO, "unbroken: saved step %d to %s%s", step, path, took,
            step=step, path=path,
        )  # fmt: skip
        if self.run.config.on_save is not None:
            with self._lock:
                self._committed.append((step, path))

    def deliver(self) -> None:
        """Call ``on_save`` for every commit since the last call (training thread)."""
        hook = self.run.config.on_save
        if hook is None:
            return
        with self._lock:
            done, self._committed = self._committed, []
        for step, path in done:
            hook(step, path)

    def stopped(self, reason: str) -> None:
        run = self.run
        _log.event(
            log,
            logging.WARNING,
            "unbroken: stopped at step %d (%s); checkpoint saved in %s; relaunch the same "
            "command to continue",
            run.counters.step,
            reason,
            run.dir,
            step=run.counters.step,
            path=run.dir,
        )

    def extended(self, target: str) -> None:
        run = self.run
        _log.event(
            log, logging.WARNING, "unbroken: %s was complete at step %d; continuing it to %s",
            run.dir, run.counters.step, target, step=run.counters.step, path=run.dir,
        )  # fmt: skip

    def model_changed(self, fields: dict[str, Any]) -> None:
        if fields.get("reason") == "resume":
            return  # the resume's own record says which checkpoint
        step = self.run.counters.step
        _log.event(
            log, logging.INFO, "unbroken: model changed at step %d: %s", step, fields, step=step
        )

    def close_failed(self, error: BaseException) -> None:
        # Closing after an error must not hide that error: the close's own failure is logged.
        _log.event(
            log, logging.ERROR, "unbroken: closing the run after an error failed: %s", error,
            rank_local=True, path=self.run.dir,
        )  # fmt: skip


def resume_text(run_dir: str, step: int, path: str) -> tuple[Any, ...]:
    """The resume line: which step, which checkpoint of which run directory."""
    where = os.path.relpath(path, run_dir) if path.startswith(run_dir + os.sep) else path
    return "unbroken: resumed %s from step %d (%s)", run_dir, step, where
