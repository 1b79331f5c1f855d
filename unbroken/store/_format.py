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
order. ``_table.read`` validates every field before anything is allocated or read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:  # torch is imported when a dtype is needed: `unbroken ls` reads only names
    import torch
    from torch.distributed.checkpoint import metadata as dcp_md

FORMAT = "unbroken-tensors"
VERSION = 2
TABLE_FILE = "tensors.json"
ALIGN = 64
MAX_DIMS = 64
MAX_ELEMENTS = 1 << 50

DTYPE_ITEMSIZE: dict[str, int] = {
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
"""Every dtype a table may name, with its size in bytes: what validating a table needs, without
torch (tests/process/test_store_tables.py checks it against torch's own dtypes)."""

if TYPE_CHECKING:
    DTYPES: dict[str, torch.dtype]
    """The names of :data:`DTYPE_ITEMSIZE` -> torch's dtypes (imports torch when first used)."""
    DTYPE_NAMES: dict[torch.dtype, str]


def __getattr__(name: str) -> Any:
    if name not in ("DTYPES", "DTYPE_NAMES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    dtypes = {n: getattr(torch, n) for n in DTYPE_ITEMSIZE}
    globals().update(DTYPES=dtypes, DTYPE_NAMES={d: n for n, d in dtypes.items()})
    return globals()[name]


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
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


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
        "dtype": __getattr__("DTYPE_NAMES")[dtype],
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


def to_metadata(table: Mapping[str, Entry]) -> dcp_md.Metadata:
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
