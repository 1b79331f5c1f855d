"""``tensors.json`` read back: streamed, validated field by field, kept in compact columns.

A table may describe a few large tensors or hundreds of thousands of tiny ones, honestly or
crafted; either way reading it costs time linear in its size and memory below its size:

- **Streamed** (_jsonstream): no document of Python objects is built; each chunk's record is
  decoded alone, checked, and its numbers appended to typed arrays (about 60 bytes a chunk;
  a JSON document costs about ten times its text). A tensor is a name plus a few array slots.
- **Bounded by the data present.** A chunk that holds bytes lies at a multiple of
  :data:`~._format.ALIGN` in a data file the manifest lists, inside it, overlapping no other:
  so the data files' sizes bound their number, and a table claiming more is refused as soon as
  the count passes that bound, before the rest is read. Chunks that hold no bytes (an empty
  shard of an uneven split) are at most one per listed file for a tensor, and tensors with no
  elements at most :data:`MAX_EMPTY_TENSORS`.
- **Exact coverage** of every tensor by its chunks, for any number of chunks (_cover).
"""

from __future__ import annotations

import itertools
import re
from array import array
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CorruptCheckpointError
from . import _format, _safeio
from ._cover import covers
from ._format import ALIGN, DTYPE_ITEMSIZE, FORMAT, MAX_DIMS, MAX_ELEMENTS, VERSION, Chunk, Entry
from ._jsonstream import JsonStream

if TYPE_CHECKING:  # reading a table needs dtype names, not torch (`unbroken ls`)
    import torch

    from ..state import TensorInfo

MAX_EMPTY_TENSORS = 1 << 16
DATA_FILE = re.compile(r"^tensors-r\d{5,}\.bin$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_MAX_BYTE = 1 << 62
_DTYPE_NAMES = list(DTYPE_ITEMSIZE)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPE_NAMES)}


class Table(Mapping[str, Entry]):
    """Every tensor of a table (name -> :class:`~._format.Entry`, built when asked for), held
    as columns: per tensor its dtype, shape and range of chunks; per chunk its file, offset,
    size, checksum and box (offsets then sizes)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files  # data file names, by index
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        self.dtype = bytearray()
        self.dims_at = array("q", [0])
        self.dims = array("q")
        self.chunk_at = array("q", [0])
        self.c_tensor = array("q")
        self.c_file = array("q")
        self.c_offset = array("q")
        self.c_nbytes = array("q")
        self.c_digest = array("Q")
        self.c_box_at = array("q", [0])
        self.c_box = array("q")

    def __getitem__(self, fqn: str) -> Entry:
        i = self.index[fqn]
        return Entry(self.dtype_of(i), self.shape_of(i), tuple(self.chunks_of(i)))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.index

    def dtype_of(self, i: int) -> torch.dtype:
        return _format.DTYPES[_DTYPE_NAMES[self.dtype[i]]]  # imports torch

    def dtype_name_of(self, i: int) -> str:
        return _DTYPE_NAMES[self.dtype[i]]

    def shape_of(self, i: int) -> tuple[int, ...]:
        return tuple(self.dims[self.dims_at[i] : self.dims_at[i + 1]])

    def n_chunks(self, i: int) -> int:
        return self.chunk_at[i + 1] - self.chunk_at[i]

    def chunk(self, j: int) -> Chunk:
        a, b = self.c_box_at[j], self.c_box_at[j + 1]
        half = (a + b) // 2
        return Chunk(
            self.names[self.c_tensor[j]],
            tuple(self.c_box[a:half]),
            tuple(self.c_box[half:b]),
            self.files[self.c_file[j]],
            self.c_offset[j],
            self.c_nbytes[j],
            f"{self.c_digest[j]:016x}",
        )

    def chunks_of(self, i: int) -> Iterator[Chunk]:
        for j in range(self.chunk_at[i], self.chunk_at[i + 1]):
            yield self.chunk(j)

    def infos(self) -> Mapping[str, TensorInfo]:
        return _Infos(self)

    def data_files(self) -> set[str]:
        return {self.files[f] for f in set(self.c_file)}

    def in_file_order(self) -> dict[str, np.ndarray]:
        """Each data file's chunks (indices) in the order they were written: by offset, and at
        one offset the empty chunks before the one holding bytes (the writer places an empty
        chunk where the next one starts). The file's checksum combines them in this order."""
        f = np.frombuffer(self.c_file, dtype=np.int64)
        off = np.frombuffer(self.c_offset, dtype=np.int64)
        nbytes = np.frombuffer(self.c_nbytes, dtype=np.int64)
        order = np.lexsort((nbytes > 0, off, f))
        bounds = np.flatnonzero(np.diff(f[order])) + 1
        return {self.files[int(f[part[0]])]: part for part in np.split(order, bounds) if part.size}


class _Infos(Mapping[str, "TensorInfo"]):
    """``CheckpointReader.tensor_infos()`` of a table: shape and dtype, made when asked for."""

    def __init__(self, table: Table) -> None:
        self.t = table

    def __getitem__(self, fqn: str) -> TensorInfo:
        from ..state import TensorInfo

        i = self.t.index[fqn]
        return TensorInfo(self.t.shape_of(i), self.t.dtype_of(i))

    def __iter__(self) -> Iterator[str]:
        return iter(self.t.names)

    def __len__(self) -> int:
        return len(self.t.names)

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.t.index


def read(fd: int, where: str, file_sizes: dict[str, int]) -> Table:
    """Read, validate and return the table in ``fd`` (see the module docstring and
    docs/checkpoint-format.md for every check); ``file_sizes``: the checkpoint's files as the
    manifest lists them and the disk confirmed."""
    s = JsonStream(fd, where)
    if s.peek() != "{":
        raise CorruptCheckpointError(f"{where} is not an unbroken tensor table")
    p = _Parser(where, file_sizes)
    fmt = version = None
    seen = False
    for key in s.members():
        if key == "format":
            fmt = s.value()
            if fmt != FORMAT:
                raise CorruptCheckpointError(f"{where} is not an unbroken tensor table")
        elif key == "version":
            version = s.value()
        elif key == "tensors" and not seen:
            seen = True
            if s.peek() != "{":
                raise CorruptCheckpointError(f"{where}: 'tensors' is missing or malformed")
            for fqn in s.members():
                p.tensor(fqn, s)
        elif key == "tensors":
            raise CorruptCheckpointError(f"{where}: 'tensors' appears twice")
        else:
            s.value()  # not ours to interpret; decoded (bounded) and dropped
    s.end()
    if fmt != FORMAT:
        raise CorruptCheckpointError(f"{where} is not an unbroken tensor table")
    if not isinstance(version, int) or isinstance(version, bool) or version != VERSION:
        raise CorruptCheckpointError(f"{where} has version {version!r}, not {VERSION}")
    if not seen:
        raise CorruptCheckpointError(f"{where}: 'tensors' is missing or malformed")
    return p.finish()


class _Parser:
    def __init__(self, where: str, file_sizes: dict[str, int]) -> None:
        self.where = where
        data = sorted(n for n in file_sizes if DATA_FILE.match(n))
        self.t = Table(data)
        self.file_index = {n: i for i, n in enumerate(data)}
        self.sizes = [file_sizes[n] for n in data]
        # Chunks holding bytes lie at distinct multiples of ALIGN inside the data files.
        self.capacity = sum(-(-s // ALIGN) for s in self.sizes)
        self.listed = len(file_sizes)
        self.nonempty = 0
        self.empty_tensors = 0

    def at(self, fqn: str) -> str:
        return f"{self.where}: tensor {fqn!r}"  # made only for a message: it costs

    def tensor(self, fqn: str, s: JsonStream) -> None:
        t = self.t
        if fqn in t.index:
            raise CorruptCheckpointError(f"{self.at(fqn)} is listed twice")
        if s.peek() != "{":
            raise CorruptCheckpointError(f"{self.at(fqn)}: its description is missing or malformed")
        first = len(t.c_file)
        small, spec = s.small_value()
        if small:  # the usual case: decoded at once, a small dict at a time
            if type(spec) is not dict:
                raise CorruptCheckpointError(
                    f"{self.at(fqn)}: its description is missing or malformed"
                )
            raw_chunks = spec.get("chunks")
            chunks = isinstance(raw_chunks, list)
            if isinstance(raw_chunks, list):
                for raw in raw_chunks:
                    self._chunk(raw, fqn)
            raw_dtype, raw_shape = spec.get("dtype"), spec.get("shape")
        else:
            raw_dtype, raw_shape, chunks = self._walk(s, fqn)
        dtype = raw_dtype if isinstance(raw_dtype, str) and raw_dtype in DTYPE_ITEMSIZE else None
        if dtype is None:
            raise CorruptCheckpointError(
                f"{self.at(fqn)} has dtype {_safeio._short(raw_dtype)}, not a known one"
            )
        shape = _ints(raw_shape) or _dims(raw_shape, self.at(fqn), "shape")
        numel = _numel(shape, fqn, self)
        if not chunks or len(t.c_file) == first:
            raise CorruptCheckpointError(
                f"{self.at(fqn)} has no chunks ('chunks' missing or empty)"
            )
        self._check_chunks(first, shape, numel, dtype, fqn)
        i = len(t.names)
        t.names.append(fqn)
        t.index[fqn] = i
        t.dtype.append(_DTYPE_CODE[dtype])
        t.dims.extend(shape)
        t.dims_at.append(len(t.dims))
        t.chunk_at.append(len(t.c_file))
        t.c_tensor.extend(itertools.repeat(i, len(t.c_file) - first))

    def _walk(self, s: JsonStream, fqn: str) -> tuple[Any, Any, bool]:
        """A description too large to decode at once (many chunks): key by key, each chunk's
        record decoded alone. Returns its dtype and shape, and whether it had chunks."""
        raw_dtype: Any = None
        raw_shape: Any = None
        chunks = False
        for key in s.members():
            if key == "chunks" and not chunks and s.peek() == "[":
                chunks = True
                # Before the dtype and shape in sorted order: checked on their own now, against
                # the tensor once its description is complete.
                for _ in s.elements():
                    self._chunk(s.value(), fqn)
            elif key == "chunks":
                raise CorruptCheckpointError(f"{self.at(fqn)}: 'chunks' is missing or malformed")
            elif key == "dtype":
                raw_dtype = s.value()
            elif key == "shape":
                raw_shape = s.value()
            else:
                s.value()
        return raw_dtype, raw_shape, chunks

    def _chunk(self, raw: Any, fqn: str) -> None:
        """One chunk's record, checked on its own and appended to the columns."""
        if type(raw) is not dict:
            raise CorruptCheckpointError(f"{self.at(fqn)}: a chunk is missing or malformed")
        get: Any = raw.get
        offsets, sizes = get("offsets"), get("sizes")
        if _ints(offsets) is None or _ints(sizes) is None or len(offsets) != len(sizes):
            self._bad_box(offsets, sizes, fqn)
        name, offset, nbytes, digest = get("file"), get("offset"), get("nbytes"), get("xxh3_64")
        f = self.file_index.get(name) if type(name) is str else None
        if f is None:
            self._bad_file(name, fqn)
        for value, what in ((offset, "chunk offset"), (nbytes, "chunk nbytes")):
            if type(value) is not int or not 0 <= value <= _MAX_BYTE:
                _safeio.want_int(value, self.at(fqn), what)
        size = self.sizes[f]  # type: ignore[index]
        if offset + nbytes > size:
            raise CorruptCheckpointError(
                f"{self.at(fqn)} lies at bytes {offset}...{offset + nbytes} but {name} has "
                f"only {size} bytes"
            )
        if type(digest) is not str or not _HEX16.match(digest):
            raise CorruptCheckpointError(f"{self.at(fqn)}: a chunk's checksum is malformed")
        if nbytes:
            if offset % ALIGN:
                raise CorruptCheckpointError(
                    f"{self.at(fqn)}: a chunk lies at byte {offset} of {name}, not a multiple "
                    f"of {ALIGN}"
                )
            self.nonempty += 1
            if self.nonempty > self.capacity:
                raise CorruptCheckpointError(
                    f"{self.where} describes more chunks than its data files can hold "
                    f"({self.capacity} of {ALIGN} bytes in {sum(self.sizes)} bytes); refused "
                    "before reading the rest"
                )
        t = self.t
        t.c_file.append(f)  # type: ignore[arg-type]
        t.c_offset.append(offset)
        t.c_nbytes.append(nbytes)
        t.c_digest.append(int(digest, 16))
        t.c_box.extend(offsets)
        t.c_box.extend(sizes)
        t.c_box_at.append(len(t.c_box))

    def _bad_box(self, offsets: Any, sizes: Any, fqn: str) -> None:
        at = self.at(fqn)
        if len(_dims(offsets, at, "chunk offsets")) != len(_dims(sizes, at, "chunk sizes")):
            raise CorruptCheckpointError(f"{at}: a chunk's offsets and sizes differ in length")

    def _bad_file(self, name: Any, fqn: str) -> None:
        at = self.at(fqn)
        _safeio.safe_name(at, name)  # refuses anything but a plain file name, naming it
        why = "which the manifest omits" if DATA_FILE.match(name) else "not a data file"
        raise CorruptCheckpointError(f"{at}: its chunk is in {name!r}, {why}")

    def _check_chunks(
        self, first: int, shape: tuple[int, ...], numel: int, dtype: str, fqn: str
    ) -> None:
        """The chunks of one tensor against its shape and dtype (its name), then their
        coverage."""
        t, ndim, item = self.t, len(shape), DTYPE_ITEMSIZE[dtype]
        end = len(t.c_file)
        if end - first == 1 and t.c_box[t.c_box_at[first] :] == _whole(shape):
            if t.c_nbytes[first] != numel * item:  # the usual case: one chunk, the whole tensor
                self._bad_nbytes(first, shape, dtype, fqn)
            if not numel:
                self._empty_tensor()
            return
        n = end - first
        box_at = np.frombuffer(t.c_box_at[first : end + 1], dtype=np.int64)  # copies: the
        wrong = np.flatnonzero(np.diff(box_at) != 2 * ndim)  # columns grow on afterwards
        if wrong.size:
            j = first + int(wrong[0])
            got = (t.c_box_at[j + 1] - t.c_box_at[j]) // 2
            raise CorruptCheckpointError(
                f"{self.at(fqn)}: a chunk has {got} dimensions, not {ndim}"
            )
        box = np.frombuffer(t.c_box[box_at[0] : box_at[-1]], dtype=np.int64).reshape(n, 2 * ndim)
        lo, size = box[:, :ndim], box[:, ndim:]
        if (lo + size > np.asarray(shape, dtype=np.int64)).any():
            raise CorruptCheckpointError(
                f"{self.at(fqn)}: a chunk lies outside shape {list(shape)}"
            )
        counts = size.prod(axis=1)  # each size within the shape: at most numel, no overflow
        wrong = np.flatnonzero(np.frombuffer(t.c_nbytes[first:end], np.int64) != counts * item)
        if wrong.size:
            j = int(wrong[0])
            self._bad_nbytes(first + j, tuple(size[j].tolist()), dtype, fqn)
        full = counts > 0
        empty = n - int(full.sum())
        if empty > self.listed:
            raise CorruptCheckpointError(
                f"{self.at(fqn)} has {empty} chunks without elements, more than one per file listed"
            )
        if not numel:
            self._empty_tensor()
            return  # every chunk inside an empty tensor is empty
        if not covers(shape, lo[full], size[full], self.at(fqn)):
            raise CorruptCheckpointError(f"{self.at(fqn)}: its chunks do not cover it exactly once")

    def _bad_nbytes(self, j: int, sizes: tuple[int, ...], dtype: str, fqn: str) -> None:
        n = 1
        for sz in sizes:
            n *= sz
        raise CorruptCheckpointError(
            f"{self.at(fqn)}: a chunk of {list(sizes)} torch.{dtype} holds "
            f"{self.t.c_nbytes[j]} bytes, not {n * DTYPE_ITEMSIZE[dtype]}"
        )

    def _empty_tensor(self) -> None:
        self.empty_tensors += 1
        if self.empty_tensors > MAX_EMPTY_TENSORS:
            raise CorruptCheckpointError(
                f"{self.where} describes more than {MAX_EMPTY_TENSORS} tensors without "
                "elements; refused before reading the rest"
            )

    def finish(self) -> Table:
        t = self.t
        off = np.frombuffer(t.c_offset, dtype=np.int64)
        nbytes = np.frombuffer(t.c_nbytes, dtype=np.int64)
        for name, order in t.in_file_order().items():
            held = order[nbytes[order] > 0]
            starts, ends = off[held], off[held] + nbytes[held]
            clash = np.flatnonzero(starts[1:] < ends[:-1])
            if clash.size:
                i = int(clash[0])
                a, b = (t.names[t.c_tensor[int(j)]] for j in held[i : i + 2])
                raise CorruptCheckpointError(
                    f"{self.where}: tensors {a!r} and {b!r} overlap in {name} at byte "
                    f"{int(starts[i + 1])}"
                )
        return t


def _ints(value: Any) -> tuple[int, ...] | None:
    """``value`` as dimensions if it is a valid list of them (the fast check), else None."""
    if type(value) is not list or len(value) > MAX_DIMS:
        return None
    for d in value:
        if type(d) is not int or not 0 <= d <= MAX_ELEMENTS:
            return None
    return tuple(value)


def _whole(shape: tuple[int, ...]) -> array[int]:
    """The box of a chunk that is the whole tensor, as the columns hold it."""
    return array("q", (0,) * len(shape) + shape)


def _dims(value: Any, at: str, what: str) -> tuple[int, ...]:
    if type(value) is not list:
        raise CorruptCheckpointError(
            f"{at}: {what} is missing or malformed ({_safeio._short(value)})"
        )
    if len(value) > MAX_DIMS:
        raise CorruptCheckpointError(f"{at}: {what} has {len(value)} dimensions")
    for d in value:
        if type(d) is not int or not 0 <= d <= MAX_ELEMENTS:
            raise CorruptCheckpointError(
                f"{at}: {what} is {_safeio._short(value)}, not integers in range"
            )
    return tuple(value)


def _numel(shape: tuple[int, ...], fqn: str, p: _Parser) -> int:
    n = 1
    for s in shape:
        n *= s
        if n > MAX_ELEMENTS:
            raise CorruptCheckpointError(
                f"{p.at(fqn)}: shape {list(shape)} is larger than any tensor"
            )
    return n
