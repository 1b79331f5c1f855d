"""The writer lock of a run directory.

``flock`` is released by the kernel when its holder dies, so a lock left by ``kill -9`` is taken
over by the next process automatically; the holder's identity is kept in the file so the
second writer's error can name it, and the takeover of a dead holder's lock can be reported.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import warnings
from typing import Any

from .._errors import LockError

LOCK_NAME = ".unbroken.lock"


class WriterLock:
    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK_NAME)
        self._fd: int | None = None
        self.previous: dict[str, Any] | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise LockError(
                f"run directory {os.path.dirname(self.path)} is being written by "
                f"{_describe(holder)}; stop that process, wait for it to finish, "
                "or use another run directory"
            ) from None
        self.previous = _read_holder(fd)
        if self.previous and self.previous.get("pid") != os.getpid():
            warnings.warn(
                f"took over the lock of {os.path.dirname(self.path)} left by "
                f"{_describe(self.previous)}, which is no longer running",
                stacklevel=3,
            )
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw) if raw else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {since})"
