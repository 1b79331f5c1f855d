"""Stop signals, from the earliest moment to process exit (torch-free: installed at import).

One handler per process for SIGTERM, SIGUSR1 and SIGINT, installed by
:func:`install_signal_handlers` (``import unbroken`` calls it when the supervisor launched the
process, :data:`unbroken._protocol.SUPERVISED`; ``Run(...)`` calls it otherwise) and never removed:

- While a :class:`StopRequest` is active (a ``Run`` that opened, until it closes), a signal only
  records the request; the loop saves at the next step boundary and exits 75. A Python handler
  runs between bytecodes, possibly inside a collective or a save, so it does nothing else. A
  second Ctrl-C interrupts at once -- except inside a save, where it is deferred until the save
  committed (a checkpoint half written is worth nothing), and then the process stops.
- Otherwise nothing is training (imports, building data, resuming, after the final save):
  nothing can be lost, so the process exits 75 (resumable) at once.

A Python-level handler that was installed before ours (e.g. Lightning's SLURM requeue on
SIGUSR1, or its SIGTERM notifier) is chained for SIGTERM and SIGUSR1: it is called after the
stop is recorded, and ours then leaves the exit to it. ``SIG_DFL``, ``SIG_IGN`` and Python's
``default_int_handler`` are not chained. Processes forked from ours (DataLoader workers) get the
default action rather than a flag nobody reads.

A process that exits 75 here (not training) leaves a stop marker for its launcher
(:mod:`unbroken._stops`), as ``Run`` does after a stop's save. Under torchrun, importing this
module also asks for a SIGTERM when the rank's parent, the torchrun agent, dies
(:func:`follow_launcher`), so a ``kill -9`` of the agent stops its ranks as a preemption would.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from . import _protocol, _stops
from ._exit import EXIT_RESUMABLE

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
CHAINED = (signal.SIGTERM, signal.SIGUSR1)

_previous: dict[int, Any] = {}  # the handlers ours chains to
_active: StopRequest | None = None
_owner = os.getpid()
_in_chain = False
# The start of a time budget where /proc cannot tell when the process started.
IMPORTED_AT = time.time()


class StopRequest:
    """The stop requested of one ``Run``: the first stop signal, and a deferred second Ctrl-C."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferred: int | None = None  # a second SIGINT that arrived inside a save
        self._saving = 0

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> bool:
        """Install the process's handlers (main thread only) and make this request the one a
        signal records; returns whether the handlers are in place. Safe to call again (e.g.
        after a framework installed handlers of its own: those are chained from then on)."""
        global _active
        if not install_signal_handlers():
            return False
        _active = self
        return True

    def uninstall(self) -> None:
        """Stop recording into this request. The handlers stay: a signal from now on (after the
        final save, say) ends the process with 75, never the default death by signal."""
        global _active
        if _active is self:
            _active = None

    def saving(self) -> _Saving:
        """A context in which a second Ctrl-C is deferred until the block ends."""
        return _Saving(self)


class _Saving:
    def __init__(self, req: StopRequest) -> None:
        self.req = req

    def __enter__(self) -> None:
        self.req._saving += 1

    def __exit__(self, *exc: object) -> None:
        self.req._saving -= 1


def install_signal_handlers() -> bool:
    """Handle SIGTERM, SIGUSR1 and SIGINT from now until the process exits.

    Call it first thing in a training script (before slow imports and data building) so that a
    stop before the ``Run`` exists is a resumable exit 75 instead of a death by signal;
    ``Run(...)`` calls it too. Main thread only (returns False elsewhere). Handlers installed by
    others since our last call are chained (SIGTERM, SIGUSR1) rather than replaced.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in STOP_SIGNALS:
        current = signal.getsignal(sig)
        if current is _handle:
            continue
        if sig in CHAINED and callable(current) and current is not signal.default_int_handler:
            _previous[sig] = current
        else:
            _previous.pop(sig, None)  # SIG_DFL / SIG_IGN / Ctrl-C's default: nothing to call
        signal.signal(sig, _handle)
    return True


def process_start() -> float:
    """When this process started (``time.time()`` scale): from ``/proc/self/stat`` on Linux,
    else the time ``unbroken`` was imported. A ``time_limit`` is counted from here."""
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
    global _in_chain
    if os.getpid() != _owner:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _in_chain:
        return  # the chained handler composed ours into itself (Lightning does): once is enough
    req = _active
    if req is not None:
        if signum == signal.SIGINT and req.signum is not None:
            if req._saving:
                req.deferred = signum
                return
            raise KeyboardInterrupt
        if req.signum is None:
            req.signum = signum
    prev = _previous.get(signum)
    if prev is not None:
        _in_chain = True
        try:
            prev(signum, frame)
        finally:
            _in_chain = False
        return  # it decides what else happens (e.g. Lightning's graceful stop)
    if req is None:
        # Nothing is training: there is nothing to save, and nothing is lost by stopping now.
        name = signal.Signals(signum).name
        msg = f"unbroken: {name} while not training (nothing to save); exit 75, relaunch to go on\n"
        try:
            os.write(2, msg.encode())
        except OSError:
            pass
        _stops.record(None, f"{name} while not training")
        raise SystemExit(EXIT_RESUMABLE)


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
