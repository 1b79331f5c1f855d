"""Every filesystem operation of a save, each announced as a named event first.

The events make fault injection exact: a test installs a hook (:func:`set_hook`; the tests'
``tests/faults.py``) that kills the process (or raises ENOSPC, EIO, ...) at the k-th event of a
real save, and asserts that every event point was reached. The library never installs one:
without a hook an event costs one ``is None`` check.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import xxhash

Hook = Callable[[str, str], None]
_hook: Hook | None = None


def set_hook(hook: Hook | None) -> Hook | None:
    """Install ``hook(event, path)``; returns the previous one."""
    global _hook
    old, _hook = _hook, hook
    return old


def event(name: str, path: str) -> None:
    if _hook is not None:
        _hook(name, path)


class HashingWriter:
    """A binary file opened for writing that hashes (xxh3-64) and counts what passes through."""

    def __init__(self, path: str) -> None:
        event("create", path)
        self.path = path
        self._f = open(path, "xb")
        self._h = xxhash.xxh3_64()
        self.size = 0
        self._started = False

    def write(self, data) -> int:
        if not self._started:
            # One event per file, not per write: torch.save writes in many small pieces.
            self._started = True
            event("write", self.path)
        n = self._f.write(data)
        self._h.update(data)
        self.size += len(memoryview(data).cast("B"))
        return n

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._f.fileno()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
            event("close", self.path)

    def digest(self) -> str:
        return self._h.hexdigest()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._f.close()
        else:
            self.close()


def write_file(path: str, data: bytes) -> tuple[int, str]:
    """Create ``path`` with ``data``; returns (size, xxh3-64 hex)."""
    with HashingWriter(path) as w:
        w.write(data)
    return w.size, w.digest()


def fsync_file(path: str) -> None:
    event("fsync", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    event("fsync_dir", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir(path: str) -> None:
    event("mkdir", path)
    os.mkdir(path)


def rename(src: str, dst: str) -> None:
    event("rename", dst)
    os.rename(src, dst)


def rmtree(path: str) -> None:
    event("rmtree", path)
    shutil.rmtree(path)


def remove_tree(path: str) -> None:
    """Remove a temp directory of ours -- a symlink planted in its place is unlinked, never
    followed."""
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)
