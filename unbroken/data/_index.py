"""The line-offset index of a text file: built once, cached, validated on every open.

The index is the start offset of every line plus the file size (``int64``, ``n + 1`` entries),
stored as ``<file>.unbroken-index.npy`` beside the data, with ``<file>.unbroken-index.json``
holding what it was built from: the file's size, ``mtime_ns``, the xxh3 of its first MiB and
the xxh3 of its whole content. Opening compares size, mtime and head checksum with the file as
it is now; any difference (or a missing or unreadable index) means the index is rebuilt -- with
a warning when an index existed. The JSON is written last, so a half-written index is never
trusted. When the data directory is not writable the index lives in ``cache_dir`` (named by a
hash of the file's absolute path) or, failing that, in memory only (with a warning).

Building the index reads the file once: it finds the newlines, checks that every line is valid
UTF-8 (naming the first bad line) and hashes the content. The content hash -- not the path or
mtime -- is the file's identity in a corpus fingerprint, so touching or moving a file keeps
saved loader positions valid, while editing it does not.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import tempfile
from typing import Any

import numpy as np
import xxhash

from ..errors import DataError
from ..process import _log

log = _log.get("data")

INDEX_VERSION = 1
HEAD_BYTES = 1 << 20
_BLOCK = 1 << 23
_SUFFIX = ".unbroken-index"


def head_hash(path: str) -> str:
    with open(path, "rb") as f:
        return xxhash.xxh3_64_hexdigest(f.read(HEAD_BYTES))


def index_paths(path: str, cache_dir: str | None) -> tuple[str, str]:
    """Where the index of ``path`` lives: beside it, or in ``cache_dir``."""
    if cache_dir is None:
        base = path + _SUFFIX
    else:
        tag = xxhash.xxh3_64_hexdigest(os.path.abspath(path).encode())[:16]
        base = os.path.join(cache_dir, f"{os.path.basename(path)}.{tag}{_SUFFIX}")
    return base + ".npy", base + ".json"


def _bad_utf8(name: str, offsets: np.ndarray, text_start: int, e: UnicodeDecodeError) -> DataError:
    at = text_start + e.start
    line = int(np.searchsorted(offsets, at, side="right")) - 1
    col = at - int(offsets[line])
    byte = e.object[e.start : e.start + 1].hex()
    return DataError(
        f"{name}: line {line + 1} is not valid UTF-8 (byte 0x{byte} at byte {col + 1} of the "
        f"line: {e.reason}); re-encode the file as UTF-8"
    )


def scan(path: str, name: str) -> tuple[np.ndarray, str]:
    """Line start offsets (+ the end) and the content's xxh3; checks UTF-8 line by line."""
    h = xxhash.xxh3_64()
    parts = [np.zeros(1, dtype=np.int64)]
    pos = 0
    carry, carry_start = b"", 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            nl = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)
            if len(nl):
                parts.append(nl.astype(np.int64) + (pos + 1))
                cut = int(nl[-1]) + 1
                text, start = carry + block[:cut], carry_start
                carry, carry_start = block[cut:], pos + cut
                try:
                    text.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _bad_utf8(name, np.concatenate(parts), start, e) from None
            else:
                carry += block
            pos += len(block)
    if carry:  # a last line without a newline
        parts.append(np.array([pos], dtype=np.int64))
        try:
            carry.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad_utf8(name, np.concatenate(parts), carry_start, e) from None
    return np.concatenate(parts), h.hexdigest()


def _atomic_write(path: str, write: Any) -> None:
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # a cache others may read (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class LineIndex:
    """One text file, its offset index and O(1) access to any line (through ``mmap``)."""

    def __init__(self, path: str | os.PathLike[str], cache_dir: str | None = None) -> None:
        self.name = os.fspath(path)
        self.path = os.path.abspath(self.name)
        if not os.path.isfile(self.path):
            what = "is not a regular file" if os.path.exists(self.path) else "does not exist"
            raise DataError(f"corpus file {self.name} {what}")
        self.npy_path, self.json_path = index_paths(self.path, cache_dir)
        self.rebuilt = False
        """True when this open built the index (first use, or the file changed)."""
        self.in_memory = False
        self._mm: mmap.mmap | None = None
        self._offsets: np.ndarray | None = None
        try:
            self.meta = self._open()
        except OSError as e:
            raise DataError(f"cannot read corpus file {self.name}: {e}") from e

    # ---- the index ----------------------------------------------------------------------------

    def _open(self) -> dict[str, Any]:
        st = os.stat(self.path)
        head = head_hash(self.path)
        now = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head_xxh3": head}
        old = self._read_meta()
        if old is not None:
            changed = [k for k, v in now.items() if old.get(k) != v]
            if not changed and old.get("version") == INDEX_VERSION and self._load(old):
                return old
            if changed:
                why = (
                    f"corpus file {self.name} changed since its index was built "
                    f"({', '.join(changed)} differ); rebuilding the index. Loader positions "
                    "saved with other contents will be refused (see restart_epoch_on_change)"
                )
            else:
                why = f"the index of {self.name} ({self.npy_path}) is unreadable; rebuilding it"
            _log.event(log, logging.WARNING, "unbroken: %s", why, path=self.path)
        offsets, content = scan(self.path, self.name)
        meta = {
            "version": INDEX_VERSION,
            **now,
            "content_xxh3": content,
            "lines": len(offsets) - 1,
        }
        self._offsets = offsets
        self.rebuilt = True
        self._write(offsets, meta)
        return meta

    def _read_meta(self) -> dict[str, Any] | None:
        try:
            with open(self.json_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def _load(self, meta: dict[str, Any]) -> bool:
        try:
            offsets = np.load(self.npy_path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return False
        ok = (
            offsets.dtype == np.int64
            and offsets.ndim == 1
            and len(offsets) == int(meta.get("lines", -1)) + 1
            and int(offsets[0]) == 0
            and int(offsets[-1]) == meta["size"]
        )
        if ok:
            self._offsets = offsets
        return ok

    def _write(self, offsets: np.ndarray, meta: dict[str, Any]) -> None:
        try:
            os.makedirs(os.path.dirname(self.npy_path), exist_ok=True)
            _atomic_write(self.npy_path, lambda f: np.save(f, offsets, allow_pickle=False))
            text = json.dumps(meta, indent=1).encode()
            _atomic_write(self.json_path, lambda f: f.write(text))  # last: the commit point
        except OSError as e:
            self.in_memory = True
            _log.event(
                log,
                logging.WARNING,
                "unbroken: cannot write the index of %s to %s (%s); keeping it in memory only, "
                "so it is rebuilt at every open -- pass cache_dir= to a writable directory to "
                "keep it",
                self.name,
                self.npy_path,
                e,
                path=self.npy_path,
            )

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:  # dropped when pickled into a worker: reload (memory-mapped)
            self._offsets = np.load(self.npy_path, mmap_mode="r", allow_pickle=False)
        return self._offsets

    def __len__(self) -> int:
        return int(self.meta["lines"])

    # ---- lines --------------------------------------------------------------------------------

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the file (one slice of the mapping)."""
        return self._map()[start:stop]

    def line(self, i: int) -> str:
        """Line ``i`` (0-based), decoded, without its ``\\n`` or ``\\r\\n``."""
        off = self.offsets
        raw = self.read(int(off[i]), int(off[i + 1]))
        if raw.endswith(b"\n"):
            raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        return raw.decode("utf-8")

    def empty_lines(self) -> np.ndarray:
        """0-based numbers of the lines holding no character (``\\r`` alone counts as empty)."""
        n = len(self)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        off = np.asarray(self.offsets)
        span = np.diff(off)
        content = span - 1  # every line but possibly the last ends with "\n"
        last = self.read(int(off[-1]) - 1, int(off[-1]))
        if last != b"\n":
            content[-1] += 1
        empty = content == 0
        one = np.flatnonzero(content == 1)
        if len(one):
            data = np.frombuffer(self._map(), dtype=np.uint8)
            empty[one[data[off[one]] == 13]] = True
            del data  # release the buffer export so the mapping can close
        return np.flatnonzero(empty)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_mm"] = None  # a mapping is per process
        if not self.in_memory:
            state["_offsets"] = None  # reloaded (memory-mapped) where it is used
        return state
