"""The one validation layer for untrusted bytes of a checkpoint directory.

Everything the store reads from a checkpoint passes through here first: file names (no
escapes), files (regular files only, opened without following links, size-bounded) and JSON
(strict: no NaN/Infinity, no number that overflows to infinity, bounded nesting). Every
failure becomes a :class:`CorruptCheckpointError` or :class:`UnsafeCheckpointError` that names
the file, never a raw ``ValueError``/``RecursionError``/``OSError``.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from typing import Any

from ..errors import CorruptCheckpointError, UnsafeCheckpointError

MAX_JSON_BYTES = 512 << 20
MAX_JSON_DEPTH = 64
"""Deeper than any state unbroken writes (a few levels), shallow enough for any recursion."""


def safe_name(directory: str, name: Any) -> str:
    if not isinstance(name, str) or not name or name in (".", ".."):
        raise UnsafeCheckpointError(f"file name {name!r} in {directory} is not a plain file name")
    if "/" in name or "\\" in name or "\0" in name:
        raise UnsafeCheckpointError(f"file name {name!r} in {directory} is not a plain file name")
    return os.path.join(directory, name)


def safe_file(directory: str, name: Any) -> str:
    """The path of ``name`` inside ``directory``; refuse escapes, links and non-regular files."""
    path = safe_name(directory, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{path} cannot be examined: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeCheckpointError(f"{path} is not a regular file (a link, FIFO or device?)")
    return path


def open_regular(path: str) -> int:
    """An fd of ``path`` for reading: never through a link, never blocking on a FIFO, and only
    if what was opened is a regular file (the path may change between a check and the open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise UnsafeCheckpointError(f"{path} cannot be opened as a plain file: {e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeCheckpointError(f"{path} is not a regular file (a link, FIFO or device?)")
    return fd


def read_small(directory: str, name: Any, limit: int) -> bytes:
    """All bytes of the regular file ``name`` in ``directory``, refusing more than ``limit``."""
    path = safe_file(directory, name)
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpointError(f"{path} is {size} bytes, more than such a file holds")
        chunks, left = [], size
        while left > 0:
            chunk = os.read(fd, min(left, 64 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows to infinity")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def parse_json(raw: bytes, where: str) -> Any:
    """Strict JSON of untrusted bytes; every failure is a CorruptCheckpointError naming it."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_float=_finite, parse_constant=_reject_constant)
    except RecursionError:
        raise CorruptCheckpointError(f"{where} is nested too deeply to be unbroken's") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {str(e)[:200]}") from None
    _check_depth(doc, where)
    return doc


def _check_depth(doc: Any, where: str) -> None:
    # Iterative, so that a deep document cannot exhaust the stack of the code that walks it;
    # a stack of iterators (one per level), not of nodes, so that a wide one costs nothing.
    stack: list[Iterator[Any]] = [iter((doc,))]
    while stack:
        for node in stack[-1]:
            if isinstance(node, dict | list) and node:
                if len(stack) >= MAX_JSON_DEPTH:
                    raise CorruptCheckpointError(
                        f"{where} is nested more than {MAX_JSON_DEPTH} levels deep; not unbroken's"
                    )
                stack.append(iter(node.values() if isinstance(node, dict) else node))
                break
        else:
            stack.pop()


def read_json(directory: str, name: str, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse ``name`` inside ``directory``: a regular file, size-bounded, strict JSON."""
    raw = read_small(directory, name, limit)
    return parse_json(raw, os.path.join(directory, name))


def want_int(value: Any, where: str, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    """``value`` as an int in [lo, hi] (bool is not an int here), else a named error."""
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptCheckpointError(f"{where}: {what} is {_short(value)}, not an integer in range")
    return value


def want(value: Any, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise CorruptCheckpointError(f"{where}: {what} is missing or malformed ({_short(value)})")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
