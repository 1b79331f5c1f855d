"""Asynchronous saving: training waits only for a copy into reused host buffers.

``save()`` snapshots every tensor of the payload into a buffer kept from the previous save,
then writes, checksums and commits in a background thread. GPU tensors go into pinned buffers
on a side stream (store/_host_buffers.py): training waits only until those copies are issued, and
the background thread waits for them to finish before it writes. At most
one save is in flight: a new one first waits for the previous (so every triggered save happens,
in order). An error of a background save is raised by the next ``save()``, ``check()`` or
``wait()`` -- the run calls ``check()`` at every step and ``wait()`` before a signal-triggered
save, at ``finish()`` and at ``close()``. One that nobody raised (the loop was left with
``break``, skipping ``finish()``) is reported when the interpreter exits, which then exits 1:
a failed save is never a silent success.

A thread, not a process: writing is I/O and hashing/copying release the GIL, so the thread
competes little with the training loop. bench/bench_async_writer.py measures both: a process was
1-2% better, within the noise, but it would need the snapshot in shared memory, a process group
of its own for a distributed save, and its errors sent back (docs/performance.md).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CheckpointWriteError
from ..process import _log
from ..state import Payload
from ..state._adapters import _is_dtensor
from ._direct import one_thread
from ._host_buffers import Stage, Staged
from ._store import CheckpointStore

log = _log.get("store")
_savers: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


class AsyncSaver:
    """Saves in a background thread: the training blocks only for the copy
    (``Run(async_save=True)``)."""

    def __init__(self, store: CheckpointStore, group: Any = None) -> None:
        self.store = store
        self.group = group
        self._stage = Stage()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None
        _savers.add(self)
        self.last_blocking_seconds = 0.0
        self.last_total_seconds = 0.0

    def save(
        self,
        step: int,
        payload: Payload,
        meta: dict[str, Any],
        after: Callable[[int], None] | None = None,
    ) -> None:
        """Snapshot now; write and commit ``step`` in the background, then call ``after(step)``."""
        self.wait()
        t0 = time.perf_counter()
        tensors, staged = self._snapshot(payload.tensors)
        snap = Payload(
            global_trees=payload.global_trees,
            local_trees=payload.local_trees,
            tensors=tensors,
            kinds=payload.kinds,
        )
        self.last_blocking_seconds = time.perf_counter() - t0

        def work() -> None:
            try:
                staged.wait()  # copies from a GPU: done before a byte is written
                self.store.save(step, snap, meta, group=self.group)
                if after is not None:
                    after(step)
            except BaseException as e:  # surfaced by the next save() or wait()
                self._error = e
            self.last_total_seconds = time.perf_counter() - t0

        # Non-daemon: the interpreter waits for it at exit (then _report_at_exit looks).
        self._step = step
        self._thread = threading.Thread(target=work, name=f"unbroken-save-{step}", daemon=False)
        self._thread.start()

    def check(self) -> None:
        """Raise the error of a background save that already failed; never blocks."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            if isinstance(err, CheckpointWriteError):
                raise err
            raise CheckpointWriteError(
                f"the background save of step {self._step} failed: {err}", step=self._step
            ) from err

    @property
    def failed(self) -> BaseException | None:
        """The error of a finished background save that nobody has raised yet."""
        return self._error

    def _snapshot(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Staged]:
        names = list(tensors)
        src = [tensors[n].detach() for n in names]
        local: list[torch.Tensor] = [t.to_local() if _is_dtensor(t) else t for t in src]  # type: ignore[attr-defined]
        with one_thread():
            staged = self._stage.copy(names, local)
        out = {n: _wrap(b, t) for n, b, t in zip(names, staged.tensors, src, strict=True)}
        return out, staged


def _wrap(buf: torch.Tensor, t: Any) -> torch.Tensor:
    if _is_dtensor(t):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return buf


@atexit.register
def _report_at_exit() -> None:
    # Non-daemon save threads are joined before atexit runs, so every save has ended here. A
    # failure nobody raised means the last checkpoint never committed: the exit status must
    # not say success. atexit cannot change the status, so exit here, once the error is logged
    # and the streams are flushed (logging.shutdown, which atexit would run after us, now).
    errors = [(s._step, s.failed) for s in list(_savers) if s.failed is not None]
    if not errors:
        return
    for step, err in errors:
        # ERROR reaches stderr even with logging unconfigured (logging.lastResort).
        _log.event(
            log,
            logging.ERROR,
            "unbroken: the background save of step %s failed and was never reported: %s; the "
            "process exits 1 (the training loop ended without run.finish() or run.close())",
            step,
            err,
            rank_local=True,
            step=step,
        )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(1)
