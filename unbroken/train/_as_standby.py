"""The warm standby's side of ``Run()`` (docs/supervise.md, "Warm standby").

``unbroken run`` starts a second process beside the trainer, with the next attempt's
environment plus :data:`unbroken.process._protocol.STANDBY`: the read end of a pipe. By default it
is a Python interpreter that waits here *before* the user's script (``supervise/_warm.py``); with
``--standby deep`` it is the same command, which runs the script as usual -- imports, data,
model -- and whose first ``Run()`` waits here, *before* it locks the run directory or reads a
checkpoint, so it touches nothing the trainer owns. When the trainer dies the supervisor
persists its newest snapshot, writes one byte and adopts the process as the next attempt: it
goes on and resumes. EOF on the pipe means the supervisor is gone (it never closes the pipe
otherwise before killing the standby): exit 75 and touch nothing.

A deep standby whose script initialised CUDA before ``Run()`` does not wait: it would hold a
second CUDA context (and whatever the script put on the GPU) beside the trainer's for as long
as it waits. It leaves its reason in its stop directory (:func:`unbroken.process._stops.refuse`) and
exits 75; the supervisor keeps a shallow standby instead.

A standby torchrun's workers inherit no fd (torchrun closes them), so theirs is a FIFO in the
supervisor's private stop area, named by the variable: each worker opens it and reads one byte;
the supervisor holds it open for writing from before the standby starts (a reader that opens it
later still finds a writer, and the bytes it wrote at the promotion), so "no writer left" means
what EOF on the pipe means. Both are read without blocking after each ``select`` timeout too: a
FIFO whose last writer went before this reader opened it never becomes ready.

While it waits the process is blocked in ``select`` (it wakes every :data:`POLL` seconds to
honour a stop signal, which ``import unbroken`` records under the supervisor): a stop ends it
with 75 and a stop marker, as any process stopped before training. The supervisor may start it
under ``SCHED_IDLE`` (only where it can be undone): every thread goes back to ``SCHED_OTHER``
here at the promotion. Torch-free.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import stat
import sys
import time
from collections.abc import Callable

from ..process import _signals, _stops
from ..process._exit import EXIT_RESUMABLE
from ..process._protocol import STANDBY, ProcessContext

log = logging.getLogger("unbroken.run")

POLL = 0.2
"""Seconds between looks at a recorded stop signal while waiting (``select`` is resumed after
a signal handler, PEP 475, so only a timeout lets the loop see it)."""
WAITING = b"standby-waiting"
"""The process's name (``ps``, ``top``, /proc/PID/comm) while it waits: 15 bytes, the limit."""

_asked = False  # only the first Run() of a process waits
at_first_run: Callable[[], None] | None = None
"""Called by the first ``Run()`` of a process that waited before its script (the shallow
standby, promoted: ``supervise/_warm.py`` sets it), then forgotten."""


def wait_for_turn() -> None:
    """In a warm standby: block until promoted (return) or told to go away (exit 75). Anywhere
    else, and in every ``Run()`` after a process's first: return at once."""
    global _asked, at_first_run
    if _asked:
        hook, at_first_run = at_first_run, None
        if hook is not None:
            hook()
        return
    _asked = True
    ctx = ProcessContext.read()
    os.environ.pop(STANDBY, None)  # not for the script's children, nor a later Run()
    if not ctx.supervised:
        return
    if ctx.standby_fifo is not None:
        fd = _open_fifo(ctx.standby_fifo)
    elif ctx.standby_fd is not None and _is_pipe(ctx.standby_fd):
        fd = ctx.standby_fd
    else:
        _signals.IN_STANDBY = False  # no pipe: not a standby after all
        return
    cuda = _cuda_initialised()
    if cuda:
        os.close(fd)
        _stops.refuse(cuda)
        raise SystemExit(EXIT_RESUMABLE)
    name = _set_name(WAITING)
    try:
        promoted = _wait(fd)
    finally:
        os.close(fd)
        _set_name(name)
    if not promoted:
        log.info("unbroken: the supervisor is gone; the standby exits (nothing was touched)")
        raise SystemExit(EXIT_RESUMABLE)
    _signals.PROMOTED_AT = time.time()  # a time_limit counts from here, not the process start
    _signals.IN_STANDBY = False  # the trainer now: its stops and failures are the job's
    _normal_priority()


def _cuda_initialised() -> str | None:
    """Why this standby must not wait, when the script initialised CUDA before ``Run()``."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
    except Exception:  # a torch too broken to say: let the script find out
        return None
    return (
        "the script initialised CUDA before Run(): waiting, the standby would hold a second "
        "CUDA context and whatever the script put on the GPU beside the trainer's"
    )


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def _open_fifo(path: str) -> int:
    """The standby torchrun's FIFO, opened for reading. Gone (the supervisor removes it when
    it ends the standby) or not a FIFO: exit 75 and touch nothing -- a standby that went on
    unpromoted would start training beside the trainer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        log.info("unbroken: the standby's FIFO %s cannot be opened (%s): it exits", path, e)
        raise SystemExit(EXIT_RESUMABLE) from None
    if not _is_pipe(fd):
        os.close(fd)
        log.warning("unbroken: the standby's FIFO %s is not a FIFO: it exits", path)
        raise SystemExit(EXIT_RESUMABLE)
    return fd


def _wait(fd: int) -> bool:
    """True when the supervisor wrote "go", False on EOF. A stop signal recorded meanwhile
    ends the process with 75 and a stop marker (nothing was training, nothing is lost)."""
    os.set_blocking(fd, False)  # this process's own read end: a look never blocks
    while True:
        _signals.honour_pending()
        ready, _, _ = select.select([fd], [], [], POLL)
        if ready:
            _signals.honour_pending()  # a stop with the supervisor's end: a stop, said so
        try:
            return bool(os.read(fd, 1))
        except BlockingIOError:
            continue  # a writer is there, nothing written yet
        except OSError:
            return False


def _normal_priority() -> None:
    """Every thread back to ``SCHED_OTHER``: the policy is per thread, and threads started
    while the process was idle (torch's pool) inherited ``SCHED_IDLE``. Again until no thread
    is left idle (one may start a thread while we go), three rounds at most."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None or os.sched_getscheduler(0) != idle:
        return  # started at the normal priority (the supervisor could not have undone it)
    for _ in range(3):
        changed = False
        for tid in _threads():
            try:
                if os.sched_getscheduler(tid) == idle:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                    changed = True
            except OSError as e:  # a thread that ended; or (never seen) EPERM
                if os.sched_getscheduler(0) == idle:
                    log.warning("unbroken: the standby could not leave SCHED_IDLE: %s", e)
                    return
        if not changed:
            return


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _set_name(name: bytes | None) -> bytes | None:
    """Name the calling (main) thread, which names the process (``ps``, ``top``); returns the
    old name (None: unknown, nothing was changed)."""
    if name is None:
        return None
    try:
        with open("/proc/self/comm", "rb") as f:
            old = f.read().rstrip(b"\n")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        return None
    return old
