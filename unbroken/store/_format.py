"""Format 2 tensor payload: raw bytes in one data file per rank, described by ``tensors.json``.

Byte layout of ``tensors-rRRRRR.bin``: the chunks (a whole tensor, or one rank's shard of it)
written by rank RRRRR, each as its raw bytes in C order (``tensor.contiguous()``'s memory),
back to back at offsets that are multiples of :data:`ALIGN`; gaps are zero. Nothing else: no
header, nothing pickled. Everything that describes the bytes is JSON, in ``tensors.json``
(written by rank 0 once every rank's chunks are known)::

    {"format": "unbroken-tensors", "version": 2,
     "tensors": {"model/0.weight": {
         "dtype": "float32", "shape": [8, 4],
         "chunks": [{"offsets": [0, 0], "sizes": [8, 4], "file": "tensors-r00000.bin",
                     "offset": 0, "nbytes": 128, "xxh3_64": "<16 hex digits>"}]}}}

``xxh3_64`` covers the chunk's bytes, so a load verifies each chunk as it reads it (one pass).
The manifest's checksum of a data file is :func:`combine` of its chunks' checksums in file
order. :func:`parse` validates every field before anything is allocated or read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from .._errors import CorruptCheckpointError
from . import _safeio

if TYPE_CHECKING:  # imported where used: reading a table (``unbroken ls``) needs no torch
    import torch
    from torch.distributed.checkpoint import metadata as dcp_md

FORMAT = "unbroken-tensors"
VERSION = 2
TABLE_FILE = "tensors.json"
ALIGN = 64
MAX_DIMS = 64
MAX_ELEMENTS = 1 << 50
MAX_CHUNKS = 1 << 16
_HEX16 = re.compile(r"^[0-9a-f]{16}$")

# The dtypes a table may name, and their sizes in bytes: validating a table needs no torch.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name in :data:`ITEMSIZE`."""
    import torch

    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype) and dtype.itemsize == ITEMSIZE[name], name
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise TypeError(f"unbroken cannot save tensors of dtype {dtype}")
    return name


def data_file(rank: int) -> str:
    return f"tensors-r{rank:05d}.bin"


@dataclass(frozen=True, slots=True)
class Chunk:
    """Where one saved chunk of a tensor lies, and its checksum."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    xxh3: str


@dataclass(frozen=True, slots=True)
class Entry:
    dtype_name: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)


def combine(digests: list[str]) -> str:
    """A data file's checksum: xxh3-64 of its chunks' checksums in file order."""
    return xxhash.xxh3_64_hexdigest("".join(digests).encode())


def encode(md: dcp_md.Metadata, chunks: list[Chunk]) -> dict[str, Any]:
    """The ``tensors.json`` document of a save: DCP's global metadata plus every chunk."""
    from torch.distributed.checkpoint import metadata as dcp_md

    by_fqn: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_fqn.setdefault(c.fqn, []).append(c)
    tensors: dict[str, Any] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, dcp_md.TensorStorageMetadata):
            raise TypeError(f"{fqn!r} is not a tensor; unbroken saves objects as JSON")
        tensors[fqn] = entry_doc(tmd.properties.dtype, tuple(tmd.size), by_fqn.get(fqn, []))
    return document(tensors)


def entry_doc(dtype: torch.dtype, shape: tuple[int, ...], chunks: list[Chunk]) -> dict[str, Any]:
    """One tensor's entry of ``tensors.json``."""
    return {
        "dtype": dtype_name(dtype),
        "shape": list(shape),
        "chunks": [
            {
                "offsets": list(c.offsets),
                "sizes": list(c.sizes),
                "file": c.file,
                "offset": c.offset,
                "nbytes": c.nbytes,
                "xxh3_64": c.xxh3,
            }
            for c in sorted(chunks, key=lambda c: c.offsets)
        ],
    }


def document(tensors: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "tensors": tensors}


def parse(doc: Any, where: str, file_sizes: dict[str, int]) -> dict[str, Entry]:
    """Validate ``tensors.json`` against the data files' sizes (``file_sizes``: name -> bytes,
    as the manifest lists and the disk confirmed). Refuses, naming ``where``: an unknown dtype,
    a shape or size that overflows, a chunk outside its tensor or its file, chunks that overlap
    in a file or do not cover their tensor exactly once."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where} is not an unbroken tensor table")
    if doc.get("version") != VERSION:
        raise CorruptCheckpointError(f"{where} has version {doc.get('version')!r}, not {VERSION}")
    tensors = _safeio.want(doc.get("tensors"), dict, where, "'tensors'")
    out: dict[str, Entry] = {}
    regions: dict[str, list[tuple[int, int, str]]] = {}
    for fqn, spec in tensors.items():
        at = f"{where}: tensor {fqn!r}"
        spec = _safeio.want(spec, dict, at, "its description")
        dtype = str(spec.get("dtype"))
        if dtype not in ITEMSIZE:
            raise CorruptCheckpointError(f"{at} has dtype {spec.get('dtype')!r}, not a known one")
        shape = _dims(spec.get("shape"), at, "shape")
        numel = _numel(shape, at)
        raw_chunks = _safeio.want(spec.get("chunks"), list, at, "'chunks'")
        if not raw_chunks or len(raw_chunks) > MAX_CHUNKS:
            raise CorruptCheckpointError(f"{at} has {len(raw_chunks)} chunks")
        chunks = tuple(_chunk(fqn, c, shape, dtype, at, file_sizes) for c in raw_chunks)
        covered = sum(_numel(c.sizes, at) for c in chunks)
        if covered != numel or (len(chunks) <= 64 and _overlap(chunks)):
            raise CorruptCheckpointError(f"{at}: its chunks do not cover it exactly once")
        for c in chunks:
            regions.setdefault(c.file, []).append((c.offset, c.nbytes, fqn))
        out[fqn] = Entry(dtype, shape, chunks)
    for name, spans in regions.items():
        spans.sort()
        for (o1, n1, f1), (o2, _, f2) in zip(spans, spans[1:], strict=False):
            if o1 + n1 > o2:
                raise CorruptCheckpointError(
                    f"{where}: tensors {f1!r} and {f2!r} overlap in {name} at byte {o2}"
                )
    return out


def _dims(value: Any, at: str, what: str) -> tuple[int, ...]:
    dims = _safeio.want(value, list, at, what)
    if len(dims) > MAX_DIMS:
        raise CorruptCheckpointError(f"{at}: {what} has {len(dims)} dimensions")
    return tuple(_safeio.want_int(d, at, what, 0, MAX_ELEMENTS) for d in dims)


def _numel(shape: tuple[int, ...], at: str) -> int:
    n = 1
    for s in shape:
        n *= s
        if n > MAX_ELEMENTS:
            raise CorruptCheckpointError(f"{at}: shape {list(shape)} is larger than any tensor")
    return n


def _chunk(
    fqn: str,
    raw: Any,
    shape: tuple[int, ...],
    dtype: str,
    at: str,
    file_sizes: dict[str, int],
) -> Chunk:
    raw = _safeio.want(raw, dict, at, "a chunk")
    offsets = _dims(raw.get("offsets"), at, "chunk offsets")
    sizes = _dims(raw.get("sizes"), at, "chunk sizes")
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise CorruptCheckpointError(f"{at}: a chunk has {len(sizes)} dimensions, not {len(shape)}")
    if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
        raise CorruptCheckpointError(f"{at}: a chunk lies outside shape {list(shape)}")
    name = raw.get("file")
    _safeio.safe_name(at, name)
    if name not in file_sizes:
        raise CorruptCheckpointError(f"{at}: its chunk is in {name!r}, which the manifest omits")
    offset = _safeio.want_int(raw.get("offset"), at, "chunk offset")
    nbytes = _safeio.want_int(raw.get("nbytes"), at, "chunk nbytes")
    if nbytes != _numel(sizes, at) * ITEMSIZE[dtype]:
        raise CorruptCheckpointError(
            f"{at}: a chunk of {list(sizes)} torch.{dtype} holds {nbytes} bytes, not "
            f"{_numel(sizes, at) * ITEMSIZE[dtype]}"
        )
    if offset + nbytes > file_sizes[name]:
        raise CorruptCheckpointError(
            f"{at} lies at bytes {offset}...{offset + nbytes} but {name} has only "
            f"{file_sizes[name]} bytes"
        )
    digest = raw.get("xxh3_64")
    if not isinstance(digest, str) or not _HEX16.match(digest):
        raise CorruptCheckpointError(f"{at}: a chunk's checksum is malformed")
    return Chunk(fqn, offsets, sizes, name, offset, nbytes, digest)


def _overlap(chunks: tuple[Chunk, ...]) -> bool:
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            empty = 0 in a.sizes or 0 in b.sizes
            if not empty and all(
                ao < bo + bs and bo < ao + as_
                for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
            ):
                return True
    return False


def to_metadata(table: dict[str, Entry]) -> dcp_md.Metadata:
    """DCP's Metadata for a validated table (storage_data maps each chunk to its Chunk)."""
    import torch
    from torch.distributed.checkpoint import metadata as dcp_md

    sdm: dict[str, Any] = {}
    storage: dict[dcp_md.MetadataIndex, Chunk] = {}
    for fqn, e in table.items():
        sdm[fqn] = dcp_md.TensorStorageMetadata(
            properties=dcp_md.TensorProperties(dtype=e.dtype),
            size=torch.Size(e.shape),
            chunks=[
                dcp_md.ChunkStorageMetadata(
                    offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)
                )
                for c in e.chunks
            ],
        )
        for c in e.chunks:
            storage[dcp_md.MetadataIndex(fqn, torch.Size(c.offsets))] = c
    return dcp_md.Metadata(
        state_dict_metadata=sdm, planner_data={k: (k,) for k in table}, storage_data=storage
    )


def file_chunks(table: dict[str, Entry]) -> dict[str, list[Chunk]]:
    """Every chunk, per data file, in file order."""
    out: dict[str, list[Chunk]] = {}
    for e in table.values():
        for c in e.chunks:
            out.setdefault(c.file, []).append(c)
    for chunks in out.values():
        chunks.sort(key=lambda c: c.offset)
    return out


def data_files(table: dict[str, Entry]) -> set[str]:
    return {c.file for e in table.values() for c in e.chunks}
