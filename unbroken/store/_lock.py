"""The writer lock of a run directory.

``flock`` is released by the kernel when its holder dies, so a lock left by ``kill -9`` is taken
over by the next process automatically; the holder's identity is kept in the file so the
second writer's error can name it, and the takeover of a dead holder's lock can be reported.

Two locks are taken: one on the run directory itself, which cannot be deleted or replaced
under a live run (so a deleted lock file lets no second writer in), and one on the lock file,
which holds the identity. The lock file is opened without following a symlink and must be a
regular file (a FIFO there cannot hang the start); after ``flock`` the locked inode must still
be the one at the path, else the file was replaced meanwhile and the lock is taken again.
Filesystems without ``flock`` on directories (NFS emulates it with byte-range locks, which need
a descriptor open for writing) keep the lock file's alone.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import socket
import time
import weakref
from typing import Any

from ..errors import CheckpointWriteError, LockError
from ..process import _log
from ..process._logfile import open_regular

log = _log.get("store")

LOCK_NAME = ".unbroken.lock"
_RETRIES = 5


_LOCKS: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def held_fds() -> list[int]:
    """The descriptors of every lock this process holds: a forked DataLoader worker closes its
    copies, so that a lock outlives neither the trainer nor a ``kill -9`` of it (a flock lasts
    while any process holds the open file)."""
    return [fd for lock in list(_LOCKS) for fd in (lock._fd, lock._dir_fd) if fd is not None]


class WriterLock:
    """The run directory's writer lock: one writing process per run directory
    (``RUN/.unbroken.lock``)."""

    def __init__(self, run_dir: str) -> None:
        _LOCKS.add(self)
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self.previous: dict[str, Any] | None = None

    def acquire(self) -> None:
        self._dir_fd = self._lock_dir()
        try:
            fd = self._lock_file()
            self.previous = _read_holder(fd)
            if self.previous and self.previous.get("pid") != os.getpid():
                _log.event(
                    log,
                    logging.WARNING,
                    "unbroken: took over the lock of %s left by %s, which is no longer running",
                    self.run_dir,
                    _describe(self.previous),
                    path=self.path,
                )
            me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(me).encode(), 0)
            except OSError as e:
                os.close(fd)  # closing releases its flock
                raise CheckpointWriteError(
                    f"cannot write the lock file {self.path}: [Errno {e.errno}] {e.strerror}"
                    + (" (the disk is full)" if e.errno == errno.ENOSPC else ""),
                    errno=e.errno,
                    path=self.path,
                ) from e
        except BaseException:
            self._close_dir()
            raise
        self._fd = fd

    def _lock_dir(self) -> int | None:
        try:
            dfd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise LockError(
                f"cannot open the run directory {self.run_dir}: {e}", path=self.run_dir
            ) from None
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_at(self.path)
            os.close(dfd)
            raise self._held_by(holder) from None
        except OSError:
            os.close(dfd)  # no flock on directories here: the lock file alone guards
            return None
        return dfd

    def _lock_file(self) -> int:
        for _ in range(_RETRIES):
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, "lock file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise self._held_by(holder) from None
            except OSError as e:
                os.close(fd)
                raise LockError(f"cannot lock {self.path}: {e}", path=self.path) from None
            if _same_file(fd, self.path):
                return fd
            os.close(fd)  # deleted or replaced between our open and our flock: again
        raise LockError(
            f"the lock file {self.path} keeps being deleted or replaced while it is taken; "
            "stop whatever removes it",
            path=self.path,
        )

    def _held_by(self, holder: dict[str, Any] | None) -> LockError:
        return LockError(
            f"run directory {self.run_dir} is being written by {_describe(holder)}; stop that "
            "process, wait for it to finish, or use another run directory",
            path=self.run_dir,
        )

    def check(self) -> None:
        """Raise if the lock file at the path is no longer ours (deleted or replaced); a
        deleted one is put back, so that the next writer still finds its holder named."""
        if self._fd is None or _same_file(self._fd, self.path):
            return
        if os.path.lexists(self.path):
            raise LockError(
                f"the lock file {self.path} was replaced while this process holds the run "
                f"directory (now it names {_describe(_holder_at(self.path))}); two writers "
                "may be running: stop one",
                path=self.path,
            )
        try:
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, "lock file")
        except FileExistsError:
            raise LockError(
                f"the lock file {self.path} was deleted and created anew by another process "
                "while this one holds the run directory; two writers may be running: stop one",
                path=self.path,
            ) from None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, os.pread(self._fd, 4096, 0), 0)
        os.close(self._fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # a full or read-only disk: the identity stays, the flock goes regardless
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            self._close_dir()

    def _close_dir(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # releases the directory's flock
            self._dir_fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _same_file(fd: int, path: str) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino) and here.st_nlink > 0


def _holder_at(path: str) -> dict[str, Any] | None:
    try:
        fd = open_regular(path, os.O_RDONLY, "lock file")
    except Exception:
        return None
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw) if raw else None
    except (OSError, ValueError, RecursionError):
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any] | None) -> str:
    """Who holds the lock, from a file anyone could have written: any odd value is shown, not
    trusted (a ``since`` of "x" or 1e300 must not crash the start)."""
    if not holder:
        return "another process"
    since = holder.get("since")
    when = "unknown time"
    if isinstance(since, (int, float)) and not isinstance(since, bool) and math.isfinite(since):
        try:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
        except (OverflowError, OSError, ValueError):
            pass
    pid, host = _short(holder.get("pid")), _short(holder.get("host"))
    return f"pid {pid} on host {host} (since {when})"


def _short(value: Any) -> str:
    text = str(value) if isinstance(value, (int, str)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def take_run_dir(lock: WriterLock) -> None:
    """Create ``lock.run_dir`` (with its parents) and take its lock. A directory that cannot be
    created or written -- a read-only file system, no permission, a full disk -- is a
    CheckpointWriteError naming it: no checkpoint could ever be saved there."""
    try:
        os.makedirs(lock.run_dir, exist_ok=True)
        lock.acquire()
    except OSError as e:
        cause = {
            errno.EROFS: "it is on a read-only file system",
            errno.EACCES: f"user {os.getuid()} may not write there",
            errno.EPERM: f"user {os.getuid()} may not write there",
            errno.ENOSPC: "the disk is full",
        }.get(e.errno or 0, f"[Errno {e.errno}] {e.strerror}")
        where = f" ({e.filename})" if e.filename and e.filename != lock.run_dir else ""
        raise CheckpointWriteError(
            f"cannot write to the run directory {lock.run_dir}{where}: {cause}; give Run a "
            "directory this process can write (or make this one writable). Nothing was changed",
            errno=e.errno,
            path=lock.run_dir,
        ) from e
