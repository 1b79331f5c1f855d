"""A quick exit after a stop: the process is gone a few tenths of a second after its stop save.

Once a stop's save is committed, what is left of the process is the interpreter's own
finalization: every ``atexit`` handler, then module teardown with several full garbage
collections over everything the script built (torch's hundreds of thousands of objects), then
the native libraries' static destructors. Measured on char_lm (``bench/bench_stop_exit.py``)
that is most of a second at idle, seconds under load -- time a relaunch waits, and time a
scheduler's grace period counts before its SIGKILL.

:func:`register` is called by ``import unbroken``, so :func:`_at_exit` is registered before
any ``atexit`` handler unbroken adds later and runs after them (``atexit`` is last in, first
out): after the multi-rank teardown (``_dist.clean_exit``), which must still collect the
garbage that holds the process groups. :func:`arm` is called when a stop ends a ``Run``. At
exit, an armed process then

1. flushes every open writable file object (an unclosed file whose only references form a
   cycle would otherwise wait for the final collections to flush it);
2. moves every object to the collector's permanent generation (``gc.freeze()``), so the
   interpreter's final collections do not walk them again. Objects still referenced at exit
   are freed by module teardown as usual (their ``__del__`` runs); what is skipped is the
   collection of *reference cycles* that become garbage only during teardown -- the Python
   documentation already does not promise that their ``__del__`` runs at exit;
3. flushes C's stdio buffers and has C's ``exit()`` end the process with its status before
   the native libraries' static destructors (glibc ``on_exit``).

Every other ``atexit`` handler still runs, those registered before ``import unbroken``
included (they run after this one); so do ``finally`` clauses and ``with`` blocks of the
script, which unwind before any of this. ``UNBROKEN_QUICK_EXIT=0`` turns it off.

Under ``unbroken run`` a process that ends by an uncaught exception is armed too
(:func:`arm_on_uncaught`, from ``import unbroken``): the supervisor's relaunch waits for it, and
in a torchrun job the agent waits for every surviving rank before it ends the job -- a rank that
crashed because its peer was killed spent 0.8 s in the interpreter's teardown after its
traceback, on the path of every recovery. The traceback is printed first (the hook it wraps).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import sys
from typing import Any

ENV = "UNBROKEN_QUICK_EXIT"

# The C base of every file object, Python-level ones (gzip, bz2) included; elsewhere than
# CPython, the ABC (slower, the same answer).
_FILE_BASE: type = getattr(sys.modules.get("_io"), "_IOBase", io.IOBase)

_registered = False
_armed_pid: int | None = None


def register() -> None:
    """Register the exit handler (``import unbroken`` does; idempotent)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(_at_exit)


def arm() -> None:
    """This process ends after a stop: make its exit quick (unless turned off)."""
    global _armed_pid
    _armed_pid = os.getpid()


def arm_on_uncaught() -> None:
    """Arm the quick exit when an uncaught exception ends the main thread (a wrapper around the
    ``sys.excepthook`` in place, which still prints the traceback; idempotent)."""
    if getattr(sys.excepthook, "_unbroken", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            previous(kind, value, tb)
        finally:
            arm()  # nothing of the script runs after this hook: only the exit

    hook._unbroken = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def armed() -> bool:
    return _armed_pid == os.getpid() and os.environ.get(ENV, "1") != "0"


def _at_exit() -> None:
    if not armed():
        return  # a forked child inherits the flag, not the stop
    flush_open_files()
    gc.disable()
    gc.freeze()
    skip_native_destructors()


def flush_open_files() -> None:
    """Flush every open, writable file object the collector knows of: text layers first,
    so their pending characters reach the buffers flushed next."""
    is_file: dict[type, bool] = {}  # per type: an isinstance per object costs ~0.2 s here
    files = []
    for obj in gc.get_objects():
        kind = type(obj)
        hit = is_file.get(kind)
        if hit is None:
            hit = is_file[kind] = issubclass(kind, _FILE_BASE)
        if hit:
            files.append(obj)
    files.sort(key=lambda f: not isinstance(f, io.TextIOBase))
    for f in files:
        try:
            if not f.closed and f.writable():
                f.flush()
        except Exception:  # an exit goes on: a broken pipe or a detached buffer is skipped
            pass


def skip_native_destructors() -> None:
    """Have C's ``exit()`` end the process with its status before the native libraries'
    static destructors run (glibc ``on_exit``, registered last so it runs first). C's stdio
    buffers are flushed now, since ``_exit`` does not."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.fflush(None)
        on_exit = libc.on_exit  # glibc: handler(status, arg), run LIFO by exit()
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)  # _exit(status)
    except (OSError, AttributeError):
        pass  # not glibc: the teardown runs as usual
