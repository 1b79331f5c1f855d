"""Asynchronous saving: training waits only for a copy into reused host buffers.

``save()`` snapshots every tensor of the payload into a buffer kept from the previous save
(pinned when CUDA is present), then writes, checksums and commits in a background thread. At most
one save is in flight: a new one first waits for the previous (so every triggered save happens,
in order). An error of a background save is raised by the next ``save()`` or by ``wait()`` --
the run calls ``wait()`` before exiting, before a signal-triggered save, and at ``finish()``.

A thread, not a process: writing is I/O and hashing/copying release the GIL, so the thread
competes little with the training loop. bench/bench_async_writer.py measures both: a process was
1-2% better, within the noise, but it would need the snapshot in shared memory, a process group
of its own for a distributed save, and its errors sent back (docs/performance.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._errors import CheckpointWriteError
from ..state import Payload
from ..state._adapters import _is_dtensor
from ._store import CheckpointStore


class AsyncSaver:
    def __init__(self, store: CheckpointStore, group: Any = None) -> None:
        self.store = store
        self.group = group
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
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
        snap = Payload(
            global_trees=payload.global_trees,
            local_trees=payload.local_trees,
            tensors=self._snapshot(payload.tensors),
            kinds=payload.kinds,
        )
        self.last_blocking_seconds = time.perf_counter() - t0

        def work() -> None:
            try:
                self.store.save(step, snap, meta, group=self.group)
                if after is not None:
                    after(step)
            except BaseException as e:  # surfaced by the next save() or wait()
                self._error = e
            self.last_total_seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=work, name=f"unbroken-save-{step}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            if isinstance(err, CheckpointWriteError):
                raise err
            raise CheckpointWriteError(f"a background save failed: {err}") from err

    def _snapshot(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        with _one_thread():
            for name, t in tensors.items():
                out[name] = self._copy(name, t.detach())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    def _copy(self, name: str, t: Any) -> torch.Tensor:
        local = t.to_local() if _is_dtensor(t) else t
        buf = self._buffers.get(name)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            pin = torch.cuda.is_available() and local.device.type == "cuda"
            buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
            self._buffers[name] = buf
        buf.copy_(local, non_blocking=True)
        if _is_dtensor(t):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        return buf


@contextmanager
def _one_thread() -> Iterator[None]:
    # A copy_ loop over many tensors is several times slower with 2+ intra-op threads on a
    # small machine (measured: 7x for 200 x 5 MB on 2 cores); memcpy needs no threads.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
