"""A format 2 tensor table read and its data files verified, without torch: what ``unbroken ls``
checks (every chunk's xxh3 and each file's combined checksum), so that the command never pays
for importing torch. Loading tensors (_storage, _direct) is where torch comes in."""

from __future__ import annotations

import os
from typing import Any

import xxhash

from .._errors import CorruptCheckpointError
from . import _format, _safeio
from ._format import Chunk, Entry


def read_table(directory: str, file_sizes: dict[str, int]) -> dict[str, Entry]:
    """Parse and validate ``tensors.json`` of ``directory`` (see _format.parse)."""
    where = os.path.join(directory, _format.TABLE_FILE)
    return _format.parse(_safeio.read_json(directory, _format.TABLE_FILE), where, file_sizes)


def verify_data(directory: str, table: dict[str, Entry], files: dict[str, Any]) -> None:
    """Check every data file's chunks against the manifest's checksum of that file."""
    for name, chunks in _format.file_chunks(table).items():
        path = _safeio.safe_file(directory, name)
        digests = hash_chunks(path, chunks)
        for c, d in zip(chunks, digests, strict=True):
            if c.xxh3 != d:
                raise CorruptCheckpointError(
                    f"{path} does not match its xxh3 checksum (corrupted) in tensor {c.fqn!r}"
                )
        rec = files.get(name)
        if rec is None or rec["xxh3_64"] != _format.combine(digests):
            raise CorruptCheckpointError(f"{path} does not match its checksum in the manifest")


def hash_chunks(path: str, chunks: list[Chunk]) -> list[str]:
    """Each chunk's xxh3 as the file holds it (a verify without a load target)."""
    fd = _safeio.open_regular(path)
    buf = bytearray(1 << 20)
    try:
        out = []
        for c in chunks:
            h = xxhash.xxh3_64()
            done = 0
            while done < c.nbytes:
                n = min(len(buf), c.nbytes - done)
                got = os.preadv(fd, [memoryview(buf)[:n]], c.offset + done)
                if got <= 0:
                    raise CorruptCheckpointError(f"{path}: tensor {c.fqn!r} is truncated")
                h.update(memoryview(buf)[:got])
                done += got
            out.append(h.hexdigest())
        return out
    finally:
        os.close(fd)
