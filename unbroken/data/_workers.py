"""The torch DataLoader that unbroken's loaders fetch through, and its worker processes.

Both loaders decide *which* samples form each batch in the main process (so batches do not
depend on the worker count) and let a torch DataLoader fetch them, with

* its own generator: creating an iterator must not draw from the global torch stream (the
  draw that makes plain StatefulDataLoader resumes inexact);
* workers that ignore SIGINT/SIGTERM/SIGUSR1: the main process finishes the step and saves;
* worker shutdown at exit, before multiprocessing's own exit hook, which would SIGTERM the
  workers -- a signal they ignore -- and then wait for them forever.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.utils.data as tud


class _Closable(Protocol):
    def close(self) -> None: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for loader in list(_LIVE):
        loader.close()


class WorkerInit:
    """Workers ignore the stop signals, die with the trainer, hold none of its locks; then
    the user's ``worker_init_fn`` runs."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn
        self.parent = os.getpid()

    def __call__(self, worker_id: int) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        _die_with_parent(self.parent)
        from ..store._lock import held_fds

        for fd in held_fds():  # forked copies: the trainer's lock must end with the trainer
            try:
                os.close(fd)
            except OSError:
                pass
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this worker when the trainer dies (Linux ``PR_SET_PDEATHSIG``): torch's own
    watchdog notices only every few seconds, and an orphan keeps the trainer's files and
    sockets (gloo peers then wait for it) open."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: torch's watchdog is the fallback
    if os.getppid() != parent:
        os._exit(0)  # the trainer died before the line above took effect


def inner_loader(
    owner: _Closable,
    fetch: Any,
    batch_sampler: Any,
    *,
    seed: int,
    num_workers: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    pin_memory: bool,
    persistent_workers: bool,
    prefetch_factor: int | None,
    worker_init_fn: Callable[[int], None] | None,
    multiprocessing_context: Any,
    timeout: float,
) -> tud.DataLoader[Any]:
    """A torch DataLoader over ``fetch`` driven by ``batch_sampler``; closes ``owner`` at exit."""
    inner: tud.DataLoader[Any] = tud.DataLoader(
        fetch,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
        prefetch_factor=prefetch_factor,
        worker_init_fn=WorkerInit(worker_init_fn),
        multiprocessing_context=multiprocessing_context,
        timeout=timeout,
        generator=torch.Generator().manual_seed(seed),
    )
    _LIVE.add(owner)
    return inner


# The iterator each inner loader handed out last. torch keeps a reference only for persistent
# workers; a pass abandoned mid-epoch (a script that breaks out and exits) would otherwise keep
# non-persistent workers alive at exit, where multiprocessing waits for them forever.
_ITERS: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def start(inner: tud.DataLoader[Any]) -> Any:
    """``iter(inner)``, remembered so that :func:`shutdown` can stop its workers."""
    it = iter(inner)
    _ITERS[inner] = weakref.ref(it)
    return it


def shutdown(inner: tud.DataLoader[Any]) -> None:
    """Stop worker processes, persistent or of a live pass (a later iteration starts new ones)."""
    ref = _ITERS.pop(inner, None)
    for it in (getattr(inner, "_iterator", None), ref() if ref is not None else None):
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
    inner._iterator = None
