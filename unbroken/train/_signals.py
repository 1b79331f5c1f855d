"""Preemption signals set a flag; the loop acts on it at the next step boundary.

The handlers live in :mod:`unbroken._signals` (torch-free, so that ``import unbroken`` can
install them before anything slow happens); see there for the whole contract.
"""

from __future__ import annotations

from .._signals import (
    CHAINED,
    STOP_SIGNALS,
    StopRequest,
    chained,
    install_signal_handlers,
    process_start,
)

__all__ = [
    "CHAINED",
    "STOP_SIGNALS",
    "StopRequest",
    "chained",
    "install_signal_handlers",
    "process_start",
]
