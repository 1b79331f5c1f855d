"""Format 1 only: reading a tensor record of a DCP data file straight into the destination.

DCP (torch_save format) stores each tensor as a small ``torch.save`` zip archive at an offset of a
``.distcp`` file. ``torch.load`` on it would unpickle ``data.pkl``, build a tensor, and then DCP
copies it into the destination: three copies of every byte. Here we parse the zip directory,
read ``data.pkl`` with an unpickler that only *records* the tensor layout (it resolves three
names and can build nothing else), and ``readinto`` the raw record bytes directly into the
destination's memory: one copy, from the page cache.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pickle
import struct
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from typing import IO, Any, NamedTuple

import torch

from .._errors import CorruptCheckpointError, UnsafeCheckpointError

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")
_MAX_PICKLE = 1 << 16


@dataclass(frozen=True, slots=True)
class Record:
    data_offset: int
    """Absolute offset of the raw tensor bytes in the file."""
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def contiguous(self) -> bool:
        expect, acc = [], 1
        for s in reversed(self.size):
            expect.append(acc)
            acc *= max(s, 1)
        return self.storage_offset == 0 and (
            tuple(reversed(expect)) == self.stride or math.prod(self.size) <= 1
        )


class _Slice(io.RawIOBase):
    """A read-only view of bytes [start, start + length) of an open file."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = min(max(base + pos, 0), self._len)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got or 0
        return got or 0


class _Layout:
    def __init__(self, storage: Any, offset: int, size: Any, stride: Any, *rest: Any) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


class _LayoutUnpickler(pickle.Unpickler):
    """Resolves exactly what ``torch.save(tensor)`` writes, to recorders; refuses the rest."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Layout
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            dtype = _storage_dtype(name)
            if dtype is not None:
                return dtype
        raise UnsafeCheckpointError(f"tensor record refers to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"unexpected persistent id {pid!r}")
        return pid


@functools.lru_cache(maxsize=64)
def _storage_dtype(name: str) -> torch.dtype | None:
    """The dtype of a legacy storage class name such as ``FloatStorage``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; we only read a name
        cls = getattr(torch, name, None)
        dtype = getattr(cls, "dtype", None) if isinstance(cls, type) else None
    return dtype if isinstance(dtype, torch.dtype) else None


class _Fallback(Exception):
    """The fast zip parse met something unusual; parse the record with zipfile instead."""


class _Member(NamedTuple):
    crc: int
    size: int
    header_offset: int


class _FastZip:
    """The central directory of a record read from its tail in one ``pread``, and members read
    from its head (where torch.save puts ``data.pkl``): two reads per tensor instead of the
    dozen small ones (and the Python-level parsing) of ``zipfile``. Only what torch.save
    writes is accepted: no zip64 fields, no comment, stored (uncompressed) members. Anything
    else raises :class:`_Fallback`, and ``zipfile`` parses the record (and reports any damage).
    """

    _EOCD = struct.Struct("<4s4H2LH")
    _CENTRAL = struct.Struct("<4s6H3L5H2L")
    _CHUNK = 4096

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length = fd, offset, length
        if length <= 2 * self._CHUNK:
            self.head = self.tail = self._pread(0, length)
            self.tail_start = 0
        else:
            self.head = self._pread(0, self._CHUNK)
            self.tail_start = length - self._CHUNK
            self.tail = self._pread(self.tail_start, self._CHUNK)
        self.members = self._directory()

    def _pread(self, start: int, n: int) -> bytes:
        data = os.pread(self.fd, n, self.offset + start)
        if len(data) != n:
            raise _Fallback
        return data

    def _bytes(self, start: int, n: int) -> bytes:
        if start < 0 or n < 0 or start + n > self.length:
            raise _Fallback
        if start + n <= len(self.head):
            return self.head[start : start + n]
        if start >= self.tail_start:
            return self.tail[start - self.tail_start : start - self.tail_start + n]
        return self._pread(start, n)

    def _directory(self) -> dict[str, _Member]:
        eocd = self.tail[-self._EOCD.size :]
        if len(eocd) != self._EOCD.size:
            raise _Fallback
        sig, disk, cd_disk, n_disk, n, cd_size, cd_offset, comment = self._EOCD.unpack(eocd)
        if sig != b"PK\x05\x06" or comment or disk or cd_disk or n_disk != n or n == 0xFFFF:
            raise _Fallback
        if cd_offset + cd_size > self.length - self._EOCD.size:
            raise _Fallback
        cd = self._bytes(cd_offset, cd_size)
        members: dict[str, _Member] = {}
        pos = 0
        for _ in range(n):
            if pos + self._CENTRAL.size > len(cd):
                raise _Fallback
            fields = self._CENTRAL.unpack_from(cd, pos)
            sig, method, crc, csize, usize = fields[0], fields[4], fields[7], fields[8], fields[9]
            name_len, extra_len, comment_len, header_offset = (
                fields[10],
                fields[11],
                fields[12],
                fields[16],
            )
            if sig != b"PK\x01\x02" or method != 0 or csize != usize or 0xFFFFFFFF in fields[8:10]:
                raise _Fallback
            if header_offset == 0xFFFFFFFF:
                raise _Fallback
            start = pos + self._CENTRAL.size
            name = cd[start : start + name_len].decode("utf-8")
            if name in members:
                raise _Fallback
            members[name] = _Member(crc, usize, header_offset)
            pos = start + name_len + extra_len + comment_len
        return members

    def data_start(self, name: str) -> int:
        """Offset (in the record) of member ``name``'s bytes, from its local header."""
        m = self.members[name]
        head = self._bytes(m.header_offset, _LOCAL_HEADER.size)
        fields = _LOCAL_HEADER.unpack(head)
        name_len, extra_len = fields[-2], fields[-1]
        if fields[0] != b"PK\x03\x04":
            raise _Fallback
        raw_name = self._bytes(m.header_offset + _LOCAL_HEADER.size, name_len)
        if raw_name != name.encode("utf-8"):
            raise _Fallback
        return m.header_offset + _LOCAL_HEADER.size + name_len + extra_len

    def read(self, name: str) -> bytes:
        """A (small) member's bytes, checked against its CRC as zipfile would."""
        m = self.members[name]
        data = self._bytes(self.data_start(name), m.size)
        if zlib.crc32(data) != m.crc:
            raise _Fallback
        return data


def _pickle_name(names: Any) -> str:
    return next(n for n in names if n.endswith("/data.pkl") or n == "data.pkl")


def locate(f: IO[bytes], offset: int, length: int, where: str) -> Record:
    """Find the raw bytes and layout of the tensor record at ``offset`` (``length`` bytes)."""
    try:
        fz: _FastZip | None = _FastZip(f.fileno(), offset, length)
    except (_Fallback, struct.error, UnicodeDecodeError, OSError, ValueError, AttributeError):
        fz = None
    if fz is not None:
        try:
            pkl_name = _pickle_name(fz.members)
            if fz.members[pkl_name].size > _MAX_PICKLE:
                raise CorruptCheckpointError(f"{where}: tensor description is too large")
            pkl = fz.read(pkl_name)
        except (_Fallback, StopIteration, KeyError, struct.error, OSError):
            fz = None
    if fz is None:
        return _locate_zipfile(f, offset, length, where)
    layout = _layout(pkl, where)
    _, dtype, key, _location, numel = layout.storage
    prefix = pkl_name[: -len("data.pkl")]
    data_name = f"{prefix}data/{key}"
    if data_name not in fz.members or not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: tensor record has no data for its storage")
    try:
        data_start = fz.data_start(data_name)
    except (_Fallback, struct.error, OSError):
        return _locate_zipfile(f, offset, length, where)
    return _record(offset, length, data_start, fz.members[data_name].size, layout, where)


def _layout(pkl: bytes, where: str) -> _Layout:
    try:
        layout = _LayoutUnpickler(io.BytesIO(pkl)).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{where}: {e}; refusing to load it") from None
    except (UnicodeDecodeError, EOFError, ValueError, KeyError) as e:
        raise CorruptCheckpointError(f"{where}: tensor record cannot be parsed: {e}") from None
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{where}: tensor record is not a plain tensor: {e}") from None
    if not isinstance(layout, _Layout) or not isinstance(layout.storage, tuple):
        raise UnsafeCheckpointError(f"{where}: tensor record is not a plain tensor")
    return layout


def _record(
    offset: int, length: int, data_start: int, file_size: int, layout: _Layout, where: str
) -> Record:
    _, dtype, _key, _location, numel = layout.storage
    if data_start + file_size > length or file_size != int(numel) * dtype.itemsize:
        raise CorruptCheckpointError(f"{where}: tensor record lies outside its slice")
    try:
        size = tuple(int(s) for s in layout.size)
        stride = tuple(int(s) for s in layout.stride)
        storage_offset = int(layout.offset)
    except (TypeError, ValueError):
        raise CorruptCheckpointError(f"{where}: tensor record has a malformed layout") from None
    if len(size) != len(stride) or any(s < 0 for s in (*size, *stride, storage_offset)):
        raise CorruptCheckpointError(f"{where}: tensor record has a malformed layout")
    # The view must lie inside the storage, before anything of its size is allocated.
    last = storage_offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
    if math.prod(size) and last >= int(numel):
        raise CorruptCheckpointError(
            f"{where}: tensor record's view {list(size)} lies outside its {numel}-element storage"
        )
    return Record(offset + data_start, file_size, dtype, size, stride, storage_offset)


def _locate_zipfile(f: IO[bytes], offset: int, length: int, where: str) -> Record:
    """:func:`locate` through ``zipfile``: slower, but parses (and rejects) any zip."""
    try:
        zf = zipfile.ZipFile(_Slice(f, offset, length))
        pkl_name = _pickle_name(zf.namelist())
        pkl_info = zf.getinfo(pkl_name)
        if pkl_info.file_size > _MAX_PICKLE:
            raise CorruptCheckpointError(f"{where}: tensor description is too large")
        pkl = zf.read(pkl_name)
    except CorruptCheckpointError:
        raise
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where}: tensor record cannot be parsed: {e}") from None
    except (zipfile.BadZipFile, StopIteration, KeyError, EOFError, ValueError, OSError) as e:
        raise CorruptCheckpointError(f"{where}: tensor record cannot be parsed: {e}") from None
    layout = _layout(pkl, where)
    _, dtype, key, _location, numel = layout.storage
    prefix = pkl_name[: -len("data.pkl")]
    try:
        info = zf.getinfo(f"{prefix}data/{key}")
    except KeyError:
        raise CorruptCheckpointError(
            f"{where}: tensor record has no data for its storage"
        ) from None
    if info.compress_type != zipfile.ZIP_STORED or not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: tensor record is compressed or untyped")
    f.seek(offset + info.header_offset)
    head = f.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: bad zip local header")
    fields = _LOCAL_HEADER.unpack(head)
    name_len, extra_len = fields[-2], fields[-1]
    data_start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    return _record(offset, length, data_start, info.file_size, layout, where)


def read_into(f: Any, rec: Record, dest: torch.Tensor, where: str) -> None:
    """Fill the contiguous CPU tensor ``dest`` (same dtype and element count) from ``rec``."""
    view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    f.seek(rec.data_offset)
    got = f.readinto(view)
    if got != rec.nbytes:
        raise CorruptCheckpointError(f"{where}: tensor record is truncated")


def read_tensor(f: IO[bytes], rec: Record, where: str) -> torch.Tensor:
    """The record as a new tensor (for records that are not contiguous: via its storage)."""
    if rec.contiguous:
        t = torch.empty(rec.size, dtype=rec.dtype)
        if t.numel():
            read_into(f, rec, t, where)
        return t
    count = rec.nbytes // rec.dtype.itemsize
    storage = torch.empty(count, dtype=rec.dtype)
    if count:
        read_into(f, rec, storage, where)
    try:
        return storage.as_strided(rec.size, rec.stride, rec.storage_offset)
    except RuntimeError as e:
        raise CorruptCheckpointError(f"{where}: tensor layout is out of bounds: {e}") from None
