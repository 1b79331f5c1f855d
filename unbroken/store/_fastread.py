"""Reading a tensor record of a DCP data file straight into the destination tensor.

DCP (torch_save format) stores each tensor as a small ``torch.save`` zip archive at an offset of a
``.distcp`` file. ``torch.load`` on it would unpickle ``data.pkl``, build a tensor, and then DCP
copies it into the destination: three copies of every byte. Here we parse the zip directory,
read ``data.pkl`` with an unpickler that only *records* the tensor layout (it resolves three
names and can build nothing else), and ``readinto`` the raw record bytes directly into the
destination's memory: one copy, from the page cache.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from typing import IO, Any

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


def _storage_dtype(name: str) -> torch.dtype | None:
    """The dtype of a legacy storage class name such as ``FloatStorage``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; we only read a name
        cls = getattr(torch, name, None)
        dtype = getattr(cls, "dtype", None) if isinstance(cls, type) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def locate(f: IO[bytes], offset: int, length: int, where: str) -> Record:
    """Find the raw bytes and layout of the tensor record at ``offset`` (``length`` bytes)."""
    try:
        zf = zipfile.ZipFile(_Slice(f, offset, length))
        names = zf.namelist()
        pkl_name = next(n for n in names if n.endswith("/data.pkl") or n == "data.pkl")
        pkl_info = zf.getinfo(pkl_name)
        if pkl_info.file_size > _MAX_PICKLE:
            raise CorruptCheckpointError(f"{where}: tensor description is too large")
        layout = _LayoutUnpickler(io.BytesIO(zf.read(pkl_name))).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{where}: {e}; refusing to load it") from None
    except CorruptCheckpointError:
        raise
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where}: tensor record cannot be parsed: {e}") from None
    except (zipfile.BadZipFile, StopIteration, KeyError, EOFError, ValueError, OSError) as e:
        raise CorruptCheckpointError(f"{where}: tensor record cannot be parsed: {e}") from None
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(f"{where}: tensor record is not a plain tensor: {e}") from None
    if not isinstance(layout, _Layout) or not isinstance(layout.storage, tuple):
        raise UnsafeCheckpointError(f"{where}: tensor record is not a plain tensor")
    _, dtype, key, _location, numel = layout.storage
    prefix = pkl_name[: -len("data.pkl")]
    info = zf.getinfo(f"{prefix}data/{key}")
    if info.compress_type != zipfile.ZIP_STORED or not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: tensor record is compressed or untyped")
    f.seek(offset + info.header_offset)
    head = f.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: bad zip local header")
    fields = _LOCAL_HEADER.unpack(head)
    name_len, extra_len = fields[-2], fields[-1]
    data_start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if data_start + info.file_size > length or info.file_size != int(numel) * dtype.itemsize:
        raise CorruptCheckpointError(f"{where}: tensor record lies outside its slice")
    size = tuple(int(s) for s in layout.size)
    stride = tuple(int(s) for s in layout.stride)
    return Record(offset + data_start, info.file_size, dtype, size, stride, int(layout.offset))


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
