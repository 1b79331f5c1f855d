"""The torch DataLoader that unbroken's loaders fetch through, and its worker processes.

Both loaders decide *which* samples form each batch in the main process (so batches do not
depend on the worker count) and let a torch DataLoader fetch them, with

* its own generator: creating an iterator must not draw from the global torch stream (the
  draw that makes plain StatefulDataLoader resumes inexact);
* workers that never die of a stop signal (:func:`protect`): a scheduler signals every
  process of the job, and a worker killed mid-pass makes torch raise in the main process
  ("DataLoader worker exited unexpectedly") wherever it is -- inside the stop's save, say.
  The main process owns the stop: it finishes the step, saves and exits 75;
* worker shutdown at exit with a deadline, before multiprocessing's own exit hook, which would
  SIGTERM the workers -- a signal they ignore -- and then wait for them forever.

A worker is started with the stop signals *blocked* (the fork inherits the mask of the thread
that forks), so a signal that arrives before the worker's set-up is held, not delivered;
:class:`WorkerInit` then ignores them (which discards one held) and unblocks. Ignoring at
``worker_init_fn`` alone would leave a window: torch's worker loop installs a C-level SIGTERM
handler that dies of any SIGTERM not sent by the parent, before it calls ``worker_init_fn``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import multiprocessing.context as mpc
import os
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch
import torch.utils.data as tud

from ..process import _signals

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
EXIT_DEADLINE = 5.0
"""Seconds the exit waits for the protected workers it killed to be gone."""


class _Closable(Protocol):
    def close(self) -> None: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # unbroken's loaders, closed at exit
_STARTED: weakref.WeakSet[Any] = weakref.WeakSet()  # protected worker processes


@contextlib.contextmanager
def _stops_blocked() -> Iterator[None]:
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Blocked:
    """A worker process started with the stop signals blocked (see the module docstring)."""

    def start(self) -> None:
        with _stops_blocked():
            super().start()  # type: ignore[misc]
        _STARTED.add(self)


class _ForkProcess(_Blocked, mpc.ForkProcess):
    pass


class _SpawnProcess(_Blocked, mpc.SpawnProcess):
    pass


class _ForkServerProcess(_Blocked, mpc.ForkServerProcess):
    pass


class _ForkContext(mpc.ForkContext):
    Process = _ForkProcess


class _SpawnContext(mpc.SpawnContext):
    Process = _SpawnProcess


class _ForkServerContext(mpc.ForkServerContext):
    Process = _ForkServerProcess


_CONTEXTS: dict[str, mpc.BaseContext] = {
    "fork": _ForkContext(),
    "spawn": _SpawnContext(),
    "forkserver": _ForkServerContext(),
}


def protected_context(context: Any) -> Any:
    """The multiprocessing context whose workers start with the stop signals blocked, for a
    DataLoader's ``multiprocessing_context`` (None: the platform's default start method; a
    context of another kind is returned unchanged)."""
    if context in _CONTEXTS.values():
        return context
    if context is None:
        name = multiprocessing.get_start_method(allow_none=True)
        name = name or multiprocessing.get_all_start_methods()[0]  # the default comes first
    elif isinstance(context, str):
        name = context
    elif isinstance(context, mpc.BaseContext):
        name = context.get_start_method()
    else:
        return context
    return _CONTEXTS.get(name, context)


class WorkerInit:
    """Workers ignore the stop signals, die with the trainer, hold none of its locks; then
    the user's ``worker_init_fn`` runs."""

    def __init__(self, user_fn: Callable[[int], None] | None) -> None:
        self.user_fn = user_fn
        self.parent = os.getpid()

    def __call__(self, worker_id: int) -> None:
        for sig in STOPS:
            signal.signal(sig, signal.SIG_IGN)  # also discards one held while blocked
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
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


def protect(loader: tud.DataLoader[Any]) -> bool:
    """Make ``loader``'s worker processes leave the stop signals to the main process (see the
    module docstring); returns whether its next iterators' workers are protected. A no-op for
    ``num_workers=0`` and for a loader protected already; workers running now (persistent
    ones started before) keep what they had until the loader starts new ones."""
    if getattr(loader, "num_workers", 0) <= 0:
        return False
    if not isinstance(loader.worker_init_fn, WorkerInit):
        loader.worker_init_fn = WorkerInit(loader.worker_init_fn)
    context = protected_context(loader.multiprocessing_context)
    if context is not loader.multiprocessing_context:
        loader.multiprocessing_context = context
    return context in _CONTEXTS.values()


L = TypeVar("L", bound=tud.DataLoader)


def protect_workers(loader: L) -> L:
    """Make a torch ``DataLoader``'s worker processes leave stop signals to the main process.

    A scheduler's stop (SLURM, Kubernetes) reaches every process of the job; a DataLoader
    worker that dies of it makes torch raise in the training process ("DataLoader worker
    exited unexpectedly"), wherever that process is -- the stop's save included. unbroken's
    loaders protect their workers; do this for a plain torch loader you iterate in a ``Run``
    (an evaluation loader, say): its workers then start with the stop signals blocked and
    ignore them, end with the main process, and are reaped at exit with a deadline.
    Returns ``loader``. With ``persistent_workers``, also give it ``generator=``: creating its
    iterator otherwise draws from the global torch stream once per process, which a resumed
    process repeats::

        val_loader = unbroken.protect_workers(torch.utils.data.DataLoader(
            val_set, batch_size=64, num_workers=2, persistent_workers=True,
            generator=torch.Generator().manual_seed(0)))
    """
    protect(loader)
    return loader


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
        multiprocessing_context=(
            protected_context(multiprocessing_context)
            if num_workers > 0
            else multiprocessing_context  # torch names what it refuses
        ),
        timeout=timeout,
        generator=torch.Generator().manual_seed(seed),
    )
    _LIVE.add(owner)
    return inner


# The iterator each inner loader handed out last. torch keeps a reference only for persistent
# workers; a pass abandoned mid-epoch (a script that breaks out and exits) would otherwise keep
# non-persistent workers alive at exit, where multiprocessing waits for them forever.
_ITERS: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def start(inner: tud.DataLoader[Any], owner: Any = None) -> Iterator[Any]:
    """``iter(inner)``, remembered so that :func:`shutdown` can stop its workers. With
    ``owner`` (the unbroken loader), each fetch is first a safe point for a requested stop."""
    it = iter(inner)
    _ITERS[inner] = weakref.ref(it)
    return it if owner is None else _fetching(it, owner)


def _fetching(it: Iterator[Any], owner: Any) -> Iterator[Any]:
    while True:
        _signals.at_fetch(owner)
        try:
            batch = next(it)
        except StopIteration:
            return
        yield batch


def shutdown(inner: tud.DataLoader[Any]) -> None:
    """Stop worker processes, persistent or of a live pass (a later iteration starts new ones)."""
    ref = _ITERS.pop(inner, None)
    for it in (getattr(inner, "_iterator", None), ref() if ref is not None else None):
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
    inner._iterator = None


_PID = os.getpid()


@atexit.register
def _close_all() -> None:
    """At exit, before multiprocessing's hook (registered earlier, so it runs later): close
    unbroken's loaders (their workers end at once), then kill the protected workers still
    running -- a framework's persistent validation workers, say, which nobody told to end and
    which ignore the SIGTERM that multiprocessing would send -- and reap them."""
    if os.getpid() != _PID:
        return  # a forked copy of this process: its parent owns the workers
    for loader in list(_LIVE):
        try:
            loader.close()
        except Exception:  # the exit goes on: what is left is killed below
            pass
    reap(EXIT_DEADLINE)


def reap(seconds: float) -> None:
    """SIGKILL the protected workers of this process still running; wait up to ``seconds``."""
    alive = [p for p in list(_STARTED) if _alive(p)]
    if not alive:
        return
    if signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL, signal.SIG_IGN, None):
        # torch's SIGCHLD handler would raise "worker killed" into this exit
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + seconds
    for p in alive:
        p.join(max(0.0, end - time.monotonic()))


def _alive(p: Any) -> bool:
    try:
        return bool(p.is_alive())
    except (AssertionError, ValueError):  # not our child, or closed
        return False
