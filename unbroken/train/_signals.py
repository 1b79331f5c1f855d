"""Preemption signals set a flag; the loop acts on it at the next step boundary.

A Python signal handler runs between bytecodes, possibly inside a collective or a save, so it
must do nothing but record the request. A second Ctrl-C interrupts at once, as users expect.
Processes forked from ours (DataLoader workers ignore these signals themselves) get the default
action rather than a flag nobody reads.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._owner = os.getpid()
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> bool:
        """Install the handlers (main thread only); returns whether they were installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
