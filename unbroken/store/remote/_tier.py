"""The remote tier of one run: fetching the checkpoint to resume from, uploads in the background.

The run calls, on rank 0 (the one that owns the run directory)::

    tier = RemoteTier(url, run_dir, store, retention)   reachable? (else RemoteStoreError)
    tier.fetch(step)           resuming from a remote checkpoint (train/_choice.py chooses):
                               fetched into the local directory first, rebuilding it
    tier.resumed(step, ...)    resuming from a local one: uploaded unless the store has it
    tier.after_commit(step)    after each local commit: upload it in the background, and
                               apply local retention, keeping what is not uploaded yet
    tier.finishing()           finish() begins: its waits below end by one deadline
    tier.close()               wait for the upload in flight (errors are logged), bounded
    tier.wait_durable()        at the end: the newest checkpoint is in the store, or an error
                               saying where it is and the command that uploads it

Every wait is bounded by ``timeout`` (``remote_finish_timeout``): a store that accepts
connections and never answers does not hold a finished run (botocore's own timeouts and
retries add up to many minutes). Past it, the upload thread (a daemon, with daemon helpers) is
abandoned: the process can exit, and the checkpoint is in the local tier.

At most one upload is in flight; when checkpoints commit faster than they upload, only the
newest waiting one is uploaded next (the skipped ones were superseded). A failed upload is
logged and retried with the next checkpoint or at the end, never raised into training: the local
tier still holds it, and the store keeps its previous complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import threading
import time

from ...errors import RemoteStoreError
from ...process import _log
from ...process._logfile import METRICS_FILE
from .. import _layout
from .._store import CheckpointStore, Retention
from ._bucket import RemoteStore

log = _log.get("store")


class RemoteTier:
    def __init__(
        self,
        url: str,
        run_dir: str,
        store: CheckpointStore,
        retention: Retention,
        timeout: float | None = None,
    ) -> None:
        self.remote = RemoteStore(url, retention)
        self.timeout = timeout  # the longest finish() (or a stop) waits for the store
        self._deadline: float | None = None  # finish()'s, once it began
        self.url = self.remote.url
        self.store = store
        self.metrics = os.path.join(run_dir, METRICS_FILE)
        self.run_dir = run_dir
        self._cond = threading.Condition()
        self._retention = threading.Lock()  # local retention: the training or upload thread
        self._pending: int | None = None
        self._busy: int | None = None
        self._failed: tuple[int, BaseException] | None = None
        self._newest: int | None = None  # the newest step handed to after_commit
        self._durable: int | None = None  # the newest step known complete in the store
        self._thread: threading.Thread | None = None
        self.last_upload_seconds: float | None = None
        started = time.time()
        self.remote.check()
        try:
            self.remote.sweep_uploads(older_than=started)
        except RemoteStoreError as e:  # some stores do not let us list uploads: not fatal
            log.debug("unbroken: could not clean up unfinished uploads in %s: %s", self.url, e)

    # ---- resuming (chosen in train/_choice.py, carried out by train/_resume.py) ------------

    def fetch(self, step: int) -> None:
        """Fetch remote checkpoint ``step`` into the local directory (every byte verified as it
        lands, committed like a local save); raises one of ``UNUSABLE`` when it does not
        verify, RemoteStoreError when the store cannot be read."""
        t0 = time.perf_counter()
        self.remote.fetch(step, self.run_dir)
        _log.event(
            log,
            logging.INFO,
            "unbroken: fetched step %d from %s into %s in %.2f s",
            step,
            self.url,
            self.store.root,
            time.perf_counter() - t0,
            step=step,
        )
        self._durable = step

    def resumed(self, step: int, *, in_store: bool) -> None:
        """The run resumes from local checkpoint ``step``: complete in the store already
        (``in_store``), or uploaded in the background."""
        if in_store:
            self._durable = step
        else:
            self._upload_if_missing(step)

    def _upload_if_missing(self, step: int) -> None:
        """The local checkpoint resumed from is newer than the store's newest (the run was
        stopped before its upload finished, or the supervisor persisted a snapshot)."""
        if self._durable is None or self._durable < step:
            self._queue(step)

    # ---- uploading ----------------------------------------------------------------------------

    def after_commit(self, step: int) -> None:
        """Upload the local checkpoint of ``step`` (just committed) in the background, and
        apply local retention, keeping what is not uploaded yet."""
        self._queue(step)
        self.retain_local()

    def retain_local(self) -> None:
        """Local retention for the newest committed step, keeping :meth:`held` (run again
        after each upload: what it kept may go once it is in the store)."""
        with self._retention:
            newest = self._newest
            if newest is not None:
                self.store.apply_retention(newest, protect=self.held())

    def _queue(self, step: int) -> None:
        with self._cond:
            if self._pending is not None and self._pending != step:
                log.info(
                    "unbroken: upload of step %d skipped: step %d is newer", self._pending, step
                )
            self._pending = step
            self._newest = step if self._newest is None else max(self._newest, step)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="unbroken-upload", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def held(self) -> set[int]:
        """Steps local retention must keep: waiting, uploading, or failed (retried later)."""
        with self._cond:
            out = {self._pending, self._busy}
            if self._failed is not None:
                out.add(self._failed[0])
        return {s for s in out if s is not None}

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    self._cond.wait()
                step, self._pending, self._busy = self._pending, None, self._pending
            try:
                self._upload(step)
                self.retain_local()
            except BaseException as e:  # logged; retried with the next checkpoint or at the end
                with self._cond:
                    self._failed = (step, e)
                _log.event(
                    log,
                    logging.WARNING,
                    "unbroken: uploading step %d to %s failed: %s; it stays in %s and the "
                    "upload is retried with the next checkpoint and at the end of the run",
                    step,
                    self.url,
                    e,
                    self.store.root,
                    step=step,
                )
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()

    def _upload(self, step: int) -> None:
        t0 = time.perf_counter()
        path = os.path.join(self.store.root, _layout.step_name(step))
        uploaded = self.remote.upload(path, self.metrics)
        with self._cond:
            self._durable = step if self._durable is None else max(self._durable, step)
            if self._failed is not None and self._failed[0] <= step:
                self._failed = None
        self.last_upload_seconds = time.perf_counter() - t0
        if uploaded:
            _log.event(
                log,
                logging.INFO,
                "unbroken: uploaded step %d to %s in %.2f s",
                step,
                self.url,
                self.last_upload_seconds,
                step=step,
            )
        try:
            deleted = self.remote.apply_retention(step, protect=())
        except RemoteStoreError as e:
            log.warning("unbroken: remote retention in %s failed: %s", self.url, e)
            return
        if deleted:
            log.info("unbroken: remote retention deleted steps %s from %s", deleted, self.url)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no upload waits or runs, at most ``timeout`` seconds; whether none
        does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def finishing(self) -> None:
        """``finish()`` begins: :meth:`close` and :meth:`wait_durable` end by one deadline,
        ``timeout`` from now."""
        if self.timeout is not None and self._deadline is None:
            self._deadline = time.monotonic() + self.timeout

    def _left(self) -> float | None:
        """Seconds the next wait may take: to finish()'s deadline, else ``timeout``."""
        if self._deadline is None:
            return self.timeout
        return max(self._deadline - time.monotonic(), 0.0)

    def upload_command(self, step: int) -> str:
        """The shell command that uploads the local checkpoint of ``step`` with its metrics
        log (what a relaunch of the finished run does, without the run)."""
        path = os.path.join(self.store.root, _layout.step_name(step))
        code = (
            "from unbroken.store import RemoteStore; "
            f"RemoteStore({json.dumps(self.url)}).upload({json.dumps(path)}, "
            f"{json.dumps(self.metrics)})"
        )
        return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"

    def _not_uploaded(self, step: int, why: str) -> str:
        path = os.path.join(self.store.root, _layout.step_name(step))
        return (
            f"the final checkpoint (step {step}) is committed in {path} but NOT in {self.url}: "
            f"{why}. It is kept there; to upload it later (with the metrics log it carries), "
            f"run:\n  {self.upload_command(step)}\nor relaunch the same training command (the "
            "run is complete: it only uploads, then exits 0)."
        )

    def wait_durable(self) -> None:
        """Return once the newest committed checkpoint is in the store; else retry its upload
        once (the network may be back) and raise RemoteStoreError saying where it is and the
        command that uploads it. Bounded: by finish()'s deadline (``timeout``)."""
        self.finishing()
        step = self._newest
        if not self.wait(self._left()):
            raise self._stuck(step)
        if step is None or (self._durable is not None and self._durable >= step):
            return
        self._queue(step)  # the retry, in the upload thread: a wait on it can be bounded
        if not self.wait(self._left()):
            raise self._stuck(step)
        if self._durable is not None and self._durable >= step:
            return
        failed = self._failed
        err = failed[1] if failed is not None else RemoteStoreError("the upload failed")
        raise RemoteStoreError(
            self._not_uploaded(step, str(err)), path=self.url, step=step
        ) from err

    def _stuck(self, step: int | None) -> RemoteStoreError:
        """The store did not answer within ``timeout``: said loudly, the command to upload."""
        assert step is not None  # an upload in flight is of a committed step
        why = (
            f"the upload did not finish within {self.timeout:g} s (remote_finish_timeout): the "
            f"store at {self.remote.objects.endpoint} accepts requests but does not answer "
            "them, or is very slow"
        )
        msg = self._not_uploaded(step, why)
        _log.event(log, logging.ERROR, "unbroken: %s", msg, step=step)
        return RemoteStoreError(msg, path=self.url, step=step)

    def close(self) -> None:
        """Wait for the upload in flight, at most ``timeout`` (finish(): to its deadline); a
        failure is logged (``wait_durable`` raises it), and so is a store that did not
        answer in time (the checkpoint is in the local tier)."""
        if not self.wait(self._left()):
            with self._cond:
                step = self._busy if self._busy is not None else self._pending
            if self._deadline is None and step is not None:  # a stop: finish() says it
                _log.event(
                    log,
                    logging.ERROR,
                    "unbroken: the upload of step %d to %s did not finish within %g s "
                    "(remote_finish_timeout); the checkpoint is in %s, and the next launch "
                    "uploads it (or run: %s)",
                    step,
                    self.url,
                    self.timeout,
                    self.store.root,
                    self.upload_command(step),
                    step=step,
                )
            return
        failed = self._failed
        if failed is not None and (self._durable is None or self._durable < failed[0]):
            _log.event(
                log,
                logging.WARNING,
                "unbroken: step %d is not in %s (its upload failed: %s); the newest checkpoint "
                "there is step %s",
                failed[0],
                self.url,
                failed[1],
                self._durable,
                step=failed[0],
            )

    @property
    def durable_step(self) -> int | None:
        """The newest step known complete in the store."""
        return self._durable
