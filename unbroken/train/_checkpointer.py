"""The run's side of saving: the writer lock, synchronous and background saves, retention,
in-memory snapshots, and telling :class:`~._events.Events` when a checkpoint is durable.

It is given the state to save (``payload, meta``) by the caller and never reads the run's
components itself; what it keeps is when the last save happened and how long it took, which the
triggers need.

Call order (every rank unless noted)::

    Checkpointer(...)            nothing touched yet
    open()                       rank 0: create the run dir, take the lock, clean a killed
                                 save's leftovers; then a barrier
    ... the run resumes (reads through ``store``, ``snapshots.source_for``) ...
    start(world_size, async_save)
    per step: check()            a background save that failed is raised here
              save(...)          when a trigger fired (collective)
              after_step(...)    an in-memory snapshot, when one is due
    close()                      wait for a save in flight, release the lock
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from .. import _dist
from ..store import AsyncSaver, CheckpointStore, Retention, WriterLock, step_name
from ..store._lock import take_run_dir
from ._events import Events
from ._snapshots import Collect, Snapshots

if TYPE_CHECKING:
    from ..store.remote._tier import RemoteTier


class Checkpointer:
    def __init__(
        self,
        run_dir: str,
        retention: Retention,
        events: Events,
        *,
        rank: int,
        snapshot_dir: str | None,
        snapshot_every: int | None,
        snapshot_copy: str = "step",
        remote: str | None = None,
        remote_retention: Retention | None = None,
        remote_timeout: float | None = None,
        schedule: dict[str, int | None] | None = None,
    ) -> None:
        self.dir, self.rank, self.events = run_dir, rank, events
        self._schedule = schedule  # max_steps, save_every: told to the launcher (verify plans)
        self.store = CheckpointStore(run_dir, retention)
        self.lock = WriterLock(run_dir)
        self._snapshot_dir, self._snapshot_every = snapshot_dir, snapshot_every
        self._snapshot_copy = snapshot_copy
        self.snapshots: Snapshots | None = None
        self._remote_url, self._remote_retention = remote, remote_retention
        self._remote_timeout = remote_timeout  # remote_finish_timeout
        self.remote: RemoteTier | None = None  # rank 0's, with remote=
        self._async: AsyncSaver | None = None
        self.last_saved_step: int | None = None
        self.last_save_seconds: float | None = None
        self.last_save_wall = time.time()

    def open(self) -> None:
        """Take the run directory (rank 0 holds the lock for every rank), then open the
        in-memory snapshot area if the supervisor gave one."""
        if self.rank == 0:
            take_run_dir(self.lock)  # an unwritable directory: CheckpointWriteError
            try:
                self.store.clean_stale()
            except BaseException:
                self.lock.release()
                raise
        _dist.set_report_dir(self.dir)  # where a timed-out collective names who did not answer
        _dist.barrier(what="start-up barrier")
        self.snapshots = Snapshots(
            self._snapshot_dir,
            self._snapshot_every,
            rank=self.rank,
            copy=self._snapshot_copy,
            run_dir=self.dir,
            schedule=self._schedule,
        )

    def start(self, *, world_size: int, async_save: bool, resumed_from: int | None) -> None:
        """Training starts: background saves from now on (if asked for)."""
        self.last_saved_step = resumed_from
        self.last_save_wall = time.time()
        if async_save:
            group = _dist.new_cpu_group() if world_size > 1 else None
            self._async = AsyncSaver(self.store, group)

    def path(self, step: int) -> str:
        return os.path.join(self.store.root, step_name(step))

    # ---- per step ------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise a background save's failure (never blocks); hooks of those that committed."""
        if self._async is not None:
            self._async.check()
            self.events.deliver()

    def save(self, step: int, payload: Any, meta: dict[str, Any], *, blocking: bool) -> str:
        """Save ``payload`` as checkpoint ``step`` (collective). In the background when saves
        are asynchronous and ``blocking`` is False: then only the copy blocks."""
        self.settle_snapshot()  # its commit must not race this save's retention
        t0 = time.perf_counter()
        path = self.path(step)
        if self._async is not None and not blocking:
            self._async.save(step, payload, meta, after=self._committed_in_background)
            # The time budget must allow for a whole save: use the last complete one.
            self.last_save_seconds = self._async.last_total_seconds or (time.perf_counter() - t0)
        else:
            if self._async is not None:
                self._async.wait()
            self.store.save(step, payload, meta)
            self._retain(step)
            self.last_save_seconds = time.perf_counter() - t0
            self.events.committed(step, path, self.last_save_seconds)
        self.last_saved_step = step
        self.last_save_wall = time.time()
        self.events.deliver()
        return path

    def check_lock(self) -> None:
        """A deleted or replaced lock file: never two writers (rank 0, before each save)."""
        if self.lock.held:
            self.lock.check()

    def settle_snapshot(self) -> float:
        """Wait for the in-memory snapshot in flight to be done; the seconds waited."""
        if self.snapshots is None:
            return 0.0
        t0 = time.perf_counter()
        self.snapshots.settle()
        return time.perf_counter() - t0

    @property
    def snapshots_idle(self) -> bool:
        """No in-memory snapshot to take or wait for: ``snapshot_committed`` and
        ``after_step`` would do nothing (a step without snapshots skips them)."""
        return self.snapshots is None or self.snapshots.idle

    def snapshot_committed(self) -> float:
        """Wait for the in-memory snapshot in flight to commit; the seconds waited."""
        if self.snapshots is None:
            return 0.0
        t0 = time.perf_counter()
        self.snapshots.committed()
        return time.perf_counter() - t0

    def after_step(
        self, step: int, saved: bool, collect: Collect, step_seconds: float | None
    ) -> float:
        """An in-memory snapshot if one is due; returns the seconds it took."""
        if self.snapshots is None:
            return 0.0
        return self.snapshots.after_step(step, saved, collect, step_seconds)

    def _retain(self, step: int) -> None:
        if self.rank != 0:
            return
        if self.remote is not None:
            self.remote.after_commit(step)  # uploaded in the background; kept locally until then
        else:
            self.store.apply_retention(step)

    def _committed_in_background(self, step: int) -> None:
        self._retain(step)
        self.events.committed(step, self.path(step))

    # ---- the end -------------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait for a background save to commit; raise its error if it failed."""
        self.settle_snapshot()
        if self._async is not None:
            self._async.wait()
        self.events.deliver()

    @property
    def background(self) -> AsyncSaver | None:
        """The background saver (None: saves block)."""
        return self._async

    def finishing(self) -> None:
        """remote=: finish() begins; its waits for the store end by one deadline."""
        if self.remote is not None:
            self.remote.finishing()

    def wait_durable(self) -> None:
        """remote=: wait until the final checkpoint is in the object store (else raise)."""
        if self.remote is not None:
            self.remote.wait_durable()

    def remote_tier(self) -> RemoteTier | None:
        """Rank 0's remote tier with ``remote=`` (made, and the store reached, on first use:
        when the resume is chosen, so that a failure there is every rank's)."""
        if self.rank != 0 or self._remote_url is None:
            return None
        if self.remote is None:
            from ..store.remote._tier import RemoteTier

            keep = self._remote_retention or self.store.retention
            self.remote = RemoteTier(
                self._remote_url, self.dir, self.store, keep, self._remote_timeout
            )
        return self.remote

    def close_remote(self) -> None:
        """End the upload in flight (a failure is logged; the local tier has the checkpoint)."""
        if self.remote is not None:
            self.remote.close()

    def release(self) -> None:
        if self.snapshots is not None:
            self.snapshots.close()
        if self.lock.held:
            self.lock.release()
