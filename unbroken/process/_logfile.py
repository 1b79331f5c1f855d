"""Reading ``RUN/metrics.jsonl`` (written by the run; read by verify, the demo and users), and
opening the run directory's own files without following what was planted there.

Kept free of torch so the command-line tools can watch a run without importing it.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from ..errors import UnsafeCheckpointError

METRICS_FILE = "metrics.jsonl"


def open_regular(path: str, flags: int, what: str) -> int:
    """``os.open`` a file of the run directory that must be a plain file of its own.

    ``O_NOFOLLOW``: a symlink planted at ``path`` is refused, never followed (its target, a
    file outside the run, would be truncated or overwritten). ``O_NONBLOCK``: a FIFO there
    cannot hang the open; ``fstat`` then refuses anything but a regular file. The returned
    descriptor is blocking again. ``what`` names the file in the error (e.g. "lock file").
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafeCheckpointError(
                f"the {what} {path} is a symbolic link (to {os.readlink(path)!r}); unbroken "
                "never writes through a link: remove it",
                path=path,
                errno=e.errno,
            ) from None
        kind = _kind(path)
        if kind is not None:
            raise UnsafeCheckpointError(
                f"the {what} {path} is {kind}, not a regular file: remove it", path=path
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeCheckpointError(
            f"the {what} {path} is {_kind_of(st.st_mode)}, not a regular file: remove it",
            path=path,
        )
    os.set_blocking(fd, True)
    return fd


def _kind(path: str) -> str | None:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else _kind_of(mode)


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def read_metrics(run_dir: str | os.PathLike[str], *, events: bool = False) -> list[dict[str, Any]]:
    """The step records of a run's metrics log, in order (``events=True`` keeps resume marks).

    A last line without its newline is one being written (or cut by a crash): left out.
    """
    path = os.path.join(run_dir, METRICS_FILE)
    fd = open_regular(path, os.O_RDONLY, "metrics log")
    with open(fd, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    lines.pop()  # b"" when the log ends with a newline, else the torn last line
    out = []
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}, line {n}: not a JSON record ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}, line {n}: not a JSON object")
        if events or "event" not in rec:
            out.append(rec)
    return out


def last_logged_step(run_dir: str | os.PathLike[str]) -> int:
    """The step of the last complete step record of a live log (0 if none yet)."""
    path = os.path.join(run_dir, METRICS_FILE)
    try:
        with open(open_regular(path, os.O_RDONLY, "metrics log"), "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 8192))
            lines = f.read().splitlines()
    except (OSError, UnsafeCheckpointError):
        return 0  # none yet, or not a log of ours (a FIFO there must not hang a watcher)
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(rec, dict) and "event" not in rec and isinstance(rec.get("step"), int):
            return int(rec["step"])
    return 0
