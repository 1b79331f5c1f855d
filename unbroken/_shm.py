"""Where in-memory snapshots live (torch-free: the supervisor imports this at start-up).

The supervisor (``unbroken run``) creates one area per supervisor -- so one per node under
torchrun -- and hands it to the trainer in :data:`ENV`; unbroken/store/_snapshot.py writes and
persists the snapshots.
"""

from __future__ import annotations

import os
import shutil

from . import _protocol

ENV = _protocol.SNAPSHOT_DIR
SHM = "/dev/shm"


def supervisor_area(pid: int | None = None, base: str = SHM) -> str:
    """The snapshot area of the supervisor ``pid`` (this process by default)."""
    return os.path.join(base, f"unbroken-{os.getuid()}-sup-{pid or os.getpid()}")


def stale_areas(base: str = SHM) -> list[str]:
    """Areas of supervisors that are gone (killed, or the machine's /dev/shm outlived them)."""
    prefix = f"unbroken-{os.getuid()}-sup-"
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return []
    out = []
    for name in names:
        pid = name[len(prefix) :]
        if pid.isdigit() and not _alive(int(pid)):
            out.append(os.path.join(base, name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def discard(area: str) -> None:
    """Remove a snapshot area (after a clean exit, or once persisted)."""
    shutil.rmtree(area, ignore_errors=True)
