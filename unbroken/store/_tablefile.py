"""``tensors.json`` and the data files it describes, read and checked without torch.

What ``CheckpointReader.verify`` needs of a format 2 checkpoint -- the table parsed (_table),
every chunk's checksum and each data file's combined one -- is bytes, names and sizes: no
tensor is made, so ``unbroken ls`` lists and verifies a run directory without importing torch.
"""

from __future__ import annotations

import os
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError
from . import _format, _safeio, _table
from ._format import Chunk
from ._safeio import safe_file
from ._table import Table

DIRECT_BATCH = 4096  # chunks in flight at once: what many tiny chunks cost stays bounded


def read_table(directory: str, file_sizes: dict[str, int]) -> Table:
    """Parse and validate ``tensors.json`` of ``directory`` (see _table.read)."""
    where = os.path.join(directory, _format.TABLE_FILE)
    fd = _safeio.open_regular(safe_file(directory, _format.TABLE_FILE))
    try:
        size = os.fstat(fd).st_size
        if size > _safeio.MAX_JSON_BYTES:
            raise CorruptCheckpointError(f"{where} is {size} bytes, more than such a file holds")
        return _table.read(fd, where, file_sizes)
    finally:
        os.close(fd)


def verify_data(directory: str, table: Table, files: dict[str, Any]) -> None:
    """Check every data file's chunks against the manifest's checksum of that file."""
    for name, order in table.in_file_order().items():
        path = safe_file(directory, name)
        combined = xxhash.xxh3_64()  # _format.combine, a chunk at a time
        for at in range(0, len(order), DIRECT_BATCH):
            chunks = [table.chunk(int(j)) for j in order[at : at + DIRECT_BATCH]]
            digests = hash_chunks(path, chunks)
            for c, d in zip(chunks, digests, strict=True):
                if c.xxh3 != d:
                    raise CorruptCheckpointError(
                        f"{path} does not match its xxh3 checksum (corrupted) in tensor {c.fqn!r}"
                    )
                combined.update(d.encode())
        rec = files.get(name)
        if rec is None or rec["xxh3_64"] != combined.hexdigest():
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
