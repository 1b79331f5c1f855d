"""Peak resident memory of this process, measured from a chosen moment (Linux /proc).

``resource.getrusage(...).ru_maxrss`` cannot be reset, and a child inherits its parent's value
across ``exec`` (a test's subprocess starts at pytest's peak): a growth measured with it can
read 0 whatever happened. Here the kernel's high-water mark is reset (``clear_refs`` 5, Linux
4.0+) and ``VmHWM`` read back.
"""

from __future__ import annotations

import ctypes
import gc


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Start measuring now; returns the resident memory at this moment (bytes). Garbage is
    collected and the C heap trimmed first, so that what is freed but kept by the allocator
    cannot hide a new allocation (it would be reused without raising the resident size)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)  # glibc
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak() -> int:
    """The highest resident memory (bytes) since :func:`reset_peak`."""
    return _status("VmHWM")
