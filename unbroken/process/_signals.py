"""Stop signals, from the earliest moment to process exit (torch-free: installed at import).

One handler per process for SIGTERM, SIGUSR1 and SIGINT, installed by
:func:`install_signal_handlers` (``import unbroken`` calls it when the supervisor launched the
process, :data:`unbroken.process._protocol.SUPERVISED`; ``Run(...)`` calls it otherwise) and never
removed. The handler only *records* a stop -- it never raises into the code it interrupted, where an
``except:`` in a library (an import, a retry loop) could swallow it. The stop is honoured at
safe points in unbroken's own code:

- while a :class:`StopRequest` is active (a ``Run`` that opened, until it closes): at the next
  step boundary (``run.step()``, a loop's step or epoch start, a fetch from the tracked loader
  between steps): save the step, exit 75;
- before that (imports, building data): nothing is training and nothing can be lost. ``Run()``
  exits 75 on entry, or at the end of its resume; a stop that no ``Run`` honours within
  :data:`START_GRACE` seconds ends the process with 75 (:func:`_backstop`);
- after a ``Run`` closed (e.g. after the final save of a completed run): the stop is kept for a
  later ``Run()`` in the same process; otherwise the script finishes with its own exit code.
  In an interactive session (a REPL, IPython, Jupyter) Ctrl-C outside a training ``Run`` is
  the usual ``KeyboardInterrupt``: nothing is training, and the session goes on.

Any number of signals, at any gaps, ask for the same stop. From the first ``atexit`` callback
that runs after a handler was installed, the stop signals are ignored, so the interpreter's
teardown (which puts default actions back) cannot turn an exit 0 or 75 into a death by signal.

A Python-level handler that was installed before ours (e.g. Lightning's SLURM requeue on
SIGUSR1, or its SIGTERM notifier) is chained for SIGTERM and SIGUSR1: it is called after the
stop is recorded. ``SIG_DFL``, ``SIG_IGN`` and Python's ``default_int_handler`` are not chained.
A process forked from ours gets the default action (a pool worker must still die of
``terminate()``), except DataLoader workers: they start with the stop signals blocked and then
ignore them (:mod:`unbroken.data._workers`); the main process owns the stop.

A process that exits 75 without training leaves a stop marker for its launcher
(:mod:`unbroken.process._stops`), as ``Run`` does after a stop's save. Under torchrun, importing
this module also asks for a SIGTERM when the rank's parent, the torchrun agent, dies
(:func:`follow_launcher`), so a ``kill -9`` of the agent stops its ranks as a preemption would.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from . import _protocol, _quick_exit, _stops
from ._exit import EXIT_RESUMABLE

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
CHAINED = (signal.SIGTERM, signal.SIGUSR1)
START_GRACE = 5.0
"""Seconds a stop received before any ``Run()`` waits for one to honour it (then exit 75)."""

_previous: dict[int, Any] = {}  # the handlers ours chains to
_active: StopRequest | None = None
_owner = os.getpid()
_in_chain = False
_pending: int | None = None  # the first stop recorded while no StopRequest was active
_pending_at = 0.0
_runs = 0  # Runs opened (or opening) in this process: the backstop is for start-up only
_wake = threading.Event()
_started = False  # the backstop thread and the exit callback exist
# The start of a time budget where /proc cannot tell when the process started.
IMPORTED_AT = time.time()
# When a warm standby was promoted to trainer (train/_as_standby.py): its budget starts there,
# not at its start (it may have waited for hours).
PROMOTED_AT = 0.0

_ctx = _protocol.ProcessContext.read()
IN_STANDBY = _ctx.supervised and (_ctx.standby_fd is not None or _ctx.standby_fifo is not None)
"""A warm standby not yet promoted (train/_as_standby.py clears it at the promotion): not the job.
A stop ends it with 75 and its stop marker, saying nothing -- "relaunch to go on" is advice for
the job, which its trainer (or a finished run's exit 0) gives -- and an uncaught exception of a
deep standby's script is said by the supervisor, not as a traceback (_stops.record_uncaught)."""


class StopRequest:
    """The stop requested of one ``Run``: the first stop signal, and how many arrived."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.at_fetch: Callable[[Any], None] | None = None
        """Called (main thread) before a loader fetches a batch while a stop is requested."""

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self, handlers: bool = True) -> bool:
        """Install the process's handlers (main thread only; with ``handlers=False`` only if
        they are installed already, e.g. by ``import unbroken`` under the supervisor) and make
        this request the one a signal records; a stop recorded before (while nothing trained)
        becomes this request's. Returns whether the handlers are in place. Safe to call again
        (e.g. after a framework installed handlers of its own: those are chained from then
        on)."""
        global _active, _pending
        if not (install_signal_handlers() if handlers else _started):
            return False
        _active = self
        if _pending is not None and self.signum is None:
            self.signum, self.count = _pending, 1
        _pending = None
        return True

    def uninstall(self) -> None:
        """Stop recording into this request. The handlers stay: a signal from now on is kept
        for a later ``Run()`` in this process; it is never a death by signal."""
        global _active
        if _active is self:
            _active = None

    def record(self, signum: int) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum


def install_signal_handlers() -> bool:
    """Handle SIGTERM, SIGUSR1 and SIGINT from now until the process exits.

    Call it first thing in a training script (before slow imports and data building) so that a
    stop before the ``Run`` exists is a resumable exit 75 instead of a death by signal;
    ``Run(...)`` calls it too. Main thread only (returns False elsewhere). Handlers installed by
    others since our last call are chained (SIGTERM, SIGUSR1) rather than replaced.
    """
    global _started
    if threading.current_thread() is not threading.main_thread():
        return False
    if os.getpid() != _owner:
        return False  # a forked child: its parent owns the stop
    for sig in STOP_SIGNALS:
        current = signal.getsignal(sig)
        if current is _handle:
            continue
        if sig in CHAINED and callable(current) and current is not signal.default_int_handler:
            _previous[sig] = current
        else:
            _previous.pop(sig, None)  # SIG_DFL / SIG_IGN / Ctrl-C's default: nothing to call
        signal.signal(sig, _handle)
    if not _started:
        _started = True
        atexit.register(_ignore_from_now)
        if not _runs:
            threading.Thread(target=_backstop, name="unbroken-stop-backstop", daemon=True).start()
    return True


def pending() -> str | None:
    """The name of a stop signal received while nothing was training, if any."""
    return signal.Signals(_pending).name if _pending is not None else None


def honour_pending() -> None:
    """A safe point outside training (``Run()`` starting): a stop received before it ends the
    process here, with 75 -- nothing was training, nothing is lost."""
    if _pending is not None:
        exit_not_training(_pending)


def run_opening() -> None:
    """A ``Run`` is opening in this process: from now on stops are honoured by Runs (the
    start-up backstop stands down; a resume may take long)."""
    global _runs
    _runs += 1
    _wake.set()  # the start-up backstop ends


def at_fetch(loader: Any) -> None:
    """Called by unbroken's loaders before each batch fetch: a safe point while a stop is
    requested (the active Run decides whether the fetch is at a step boundary)."""
    req = _active
    if req is not None and req.signum is not None and req.at_fetch is not None:
        req.at_fetch(loader)


def process_start() -> float:
    """When this process started (``time.time()`` scale): from ``/proc/self/stat`` on Linux,
    else the time ``unbroken`` was imported; for a promoted standby, its promotion. A
    ``time_limit`` is counted from here."""
    return max(_started_at(), PROMOTED_AT)


def _started_at() -> float:
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime), counted from after "(comm)"
        with open("/proc/stat", "rb") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith(b"btime "))
        started = btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return IMPORTED_AT
    # btime is whole seconds and the clock may have been stepped since boot: trust /proc only
    # when it agrees with what this process has seen.
    if started > IMPORTED_AT + 1 or started < IMPORTED_AT - 365 * 86400:
        return IMPORTED_AT
    return min(started, IMPORTED_AT)


def chained(sig: int) -> Any:
    """The handler ours calls after recording ``sig`` (None: none)."""
    return _previous.get(sig)


def _handle(signum: int, frame: FrameType | None) -> None:
    global _in_chain, _pending, _pending_at
    if os.getpid() != _owner:
        # Forked from ours without unbroken's worker set-up (a multiprocessing pool, say): the
        # default action, as if we had never installed a handler.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _in_chain:
        return  # the chained handler composed ours into itself (Lightning does): once is enough
    req = _active
    if req is not None:
        req.record(signum)
        if req.count == 2:
            _say(f"{signal.Signals(signum).name} again: still stopping after the save")
    elif signum == signal.SIGINT and _interactive():
        raise KeyboardInterrupt  # a notebook or REPL, nothing training: Ctrl-C as always
    elif _pending is None:
        _pending, _pending_at = signum, time.monotonic()
        _wake.set()
    prev = _previous.get(signum)
    if prev is not None:
        _in_chain = True
        try:
            prev(signum, frame)
        finally:
            _in_chain = False


def _interactive() -> bool:
    """A REPL, ``python -i`` or IPython/Jupyter: a session the user drives, not a script."""
    return bool(sys.flags.interactive) or hasattr(sys, "ps1") or "IPython" in sys.modules


def _say(text: str) -> None:
    # A handler may run while the main thread holds a logging lock: write the fd directly.
    try:
        os.write(2, f"unbroken: {text}\n".encode())
    except OSError:
        pass


def exit_not_training(signum: int) -> None:
    """End the process with 75 for a stop received while nothing was training."""
    name = signal.Signals(signum).name
    if not IN_STANDBY:
        _say(f"{name} while not training (nothing to save); exit 75, relaunch to go on")
    _stops.record(None, f"{name} while not training")
    _quick_exit.arm()
    raise SystemExit(EXIT_RESUMABLE)


def _backstop() -> None:
    """A stop received at start-up that no ``Run()`` came to honour (a script still importing,
    or one that never builds a Run): end the process with 75 after :data:`START_GRACE`
    seconds. Nothing trained yet, so a hard exit loses nothing. The thread ends when the first
    ``Run`` opens: from then on Runs honour stops themselves."""
    while not _runs:
        if _pending is None:
            _wake.wait(1.0)
            continue
        left = START_GRACE - (time.monotonic() - _pending_at)
        if left > 0:
            time.sleep(min(left, 0.1))
            continue
        name = signal.Signals(_pending).name
        if not IN_STANDBY:
            _say(f"{name} at start-up, no Run came to save; exit 75, relaunch to go on")
        _stops.record(None, f"{name} while not training")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(EXIT_RESUMABLE)


def _ignore_from_now() -> None:
    """At exit: ignore the stop signals (the exit code is decided; the interpreter's teardown
    would put the default actions back, and a late signal would then kill the process)."""
    if os.getpid() != _owner or threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is _handle:
            signal.signal(sig, signal.SIG_IGN)


def follow_launcher() -> None:
    """Under torchrun: SIGTERM this rank when the agent that started it dies (Linux
    ``PR_SET_PDEATHSIG``). torchrun starts each rank in a session of its own, so a ``kill -9``
    of the agent would leave the ranks training on as orphans, holding the run's lock and the
    master port; with this every rank gets a stop at once and they stop together as on a
    preemption: save, exit 75. Called when ``unbroken`` is imported."""
    if not _protocol.ProcessContext.read().under_torchrun or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)  # the agent died before the line above took effect


follow_launcher()
