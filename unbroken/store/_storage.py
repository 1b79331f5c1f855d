"""Format 2's bytes: each rank's chunks in one raw data file (_direct), the JSON table (_format),
and a load that reads each chunk straight into its tensor, verifying its checksum as it goes.
Nothing is pickled, and nothing read is ever unpickled.

In one process with plain tensors -- the common case -- save and load are done here, without
DCP's planning (a per-tensor cost that dominates for many small tensors); DTensors, several
ranks and resharding go through ``dcp.save`` / ``dcp.load`` with the storage writer and reader
of :mod:`._dcp`, which produce and consume the very same files. That module, and
``torch.distributed.checkpoint`` with it, is imported only then: DCP imports FSDP and DTensor,
about 0.8 s of CPU that every training process paid at its first save.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from . import _direct, _format, _fsops
from ._format import Chunk
from ._manifest import dumps
from ._safeio import safe_file
from ._table import Table
from ._tablefile import DIRECT_BATCH
from ._tablefile import read_table as read_table
from ._tablefile import verify_data as verify_data

_local = threading.local()


@contextmanager
def data_files_into(slots: Any) -> Iterator[None]:
    """Write this thread's data files into ``slots`` (an in-memory snapshot's fixed slots,
    store/snapshot/_slots.py) instead of new files. Thread-local: an async durable save running in
    its own thread meanwhile is not affected."""
    old = getattr(_local, "slots", None)
    _local.slots = slots
    try:
        yield
    finally:
        _local.slots = old


def _write_file(
    directory: str,
    name: str,
    pairs: list[tuple[Any, torch.Tensor]],
    records: dict,
    slots: Any = None,
) -> list[Chunk]:
    """Write one data file; each pair is (a WriteItem, or (fqn, shape) in the direct path)."""
    path = os.path.join(directory, name)
    write = _direct.write_chunks if slots is None else slots.write_chunks
    placed, size = write(path, pairs)
    chunks = []
    for key, offset, nbytes, digest in placed:
        if isinstance(key, tuple):
            fqn, offsets, sizes = key
        else:
            fqn = key.index.fqn
            offsets, sizes = (
                tuple(key.tensor_data.chunk.offsets),
                tuple(key.tensor_data.chunk.sizes),
            )
        chunks.append(Chunk(fqn, tuple(offsets), tuple(sizes), name, offset, nbytes, digest))
    records[name] = (size, _format.combine([c.xxh3 for c in chunks]))
    return chunks


def write_tensors(
    directory: str, tensors: Mapping[str, torch.Tensor], group: Any = None
) -> dict[str, tuple[int, str]]:
    """Write ``tensors`` as format 2 into ``directory``; returns {file: (size, xxh3)} of this
    rank. Collective when a process group is initialized: every rank calls it."""
    from .. import _dist

    slots = getattr(_local, "slots", None)
    if not _dist.active() and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors.values()
    ):
        return _write_direct(directory, tensors, slots)
    from . import _dcp  # deferred: see the module's docstring

    return _dcp.write_tensors(directory, tensors, slots, group)


def _write_direct(
    directory: str, tensors: Mapping[str, torch.Tensor], slots: Any = None
) -> dict[str, tuple[int, str]]:
    records: dict[str, tuple[int, str]] = {}
    pairs = [((k, (0,) * t.dim(), tuple(t.shape)), t) for k, t in tensors.items()]
    chunks = _write_file(directory, _format.data_file(0), pairs, records, slots)
    records[_format.TABLE_FILE] = _fsops.write_file(
        os.path.join(directory, _format.TABLE_FILE), table_bytes(chunks, tensors)
    )
    return records


_TEMPLATES: dict[tuple, tuple[bytes, list[int]]] = {}
_DIGEST_RE = re.compile(rb'"xxh3_64":"([0-9a-f]{16})"')


def table_bytes(chunks: list[Chunk], tensors: Mapping[str, torch.Tensor]) -> bytes:
    """``tensors.json`` of whole tensors, exactly ``dumps`` of its document. Saves of one
    layout differ only in the checksums, so the JSON is made once per layout with placeholders
    and each save patches its 16-digit checksums in: encoding the table cost 0.75 ms of a 3.7
    ms in-memory snapshot of a 204-tensor state, every step (bench/bench_snapshot.py)."""
    key = tuple((c.fqn, tensors[c.fqn].dtype, c.sizes, c.file, c.offset, c.nbytes) for c in chunks)
    hit = _TEMPLATES.get(key)
    if hit is None:
        marks = [f"{i:016x}" for i in range(len(chunks))]
        doc = _format.document(
            {
                c.fqn: _format.entry_doc(
                    tensors[c.fqn].dtype, c.sizes, [dataclasses.replace(c, xxh3=m)]
                )
                for c, m in zip(chunks, marks, strict=True)
            }
        )
        raw = dumps(doc)
        # One pass over the JSON (an index() per mark would rescan it: quadratic).
        found = {m.group(1): m.start(1) for m in _DIGEST_RE.finditer(raw)}
        at = [found[m.encode()] for m in marks]
        if len(_TEMPLATES) >= 4:
            _TEMPLATES.pop(next(iter(_TEMPLATES)))
        hit = _TEMPLATES[key] = (raw, at)
    raw, at = hit
    out = bytearray(raw)
    for pos, c in zip(at, chunks, strict=True):
        out[pos : pos + 16] = c.xxh3.encode()
    return bytes(out)


# ---- reading ------------------------------------------------------------------------------------


def _fits(target: torch.Tensor, dtype: torch.dtype, nbytes: int) -> bool:
    return (
        target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == dtype
        and target.numel() * target.element_size() == nbytes
    )


def load_tensors(
    directory: str, table: Table, targets: dict[str, torch.Tensor], verify: bool = True
) -> None:
    """Fill ``targets`` (name -> preallocated tensor) from the format-2 payload of
    ``directory``; a chunk whose bytes do not match its checksum raises CorruptCheckpointError
    (the targets are then partly overwritten: the caller loads another checkpoint over them)."""
    from .. import _dist

    if not targets:
        return
    if not _dist.active() and _load_direct(directory, table, targets, verify):
        return
    from . import _dcp  # deferred: see the module's docstring

    _dcp.load_tensors(directory, table, targets, verify)


def _load_direct(
    directory: str, table: Table, targets: dict[str, torch.Tensor], verify: bool
) -> bool:
    """In one process, when every target is a plain tensor with the saved shape and dtype,
    read each chunk straight into its part of the target (into a temporary first where that
    part is not contiguous) without DCP's planning. Returns False, having read nothing, for
    anything else (DCP handles or reports it)."""
    dests: dict[int, torch.Tensor] = {}
    for fqn, target in targets.items():
        i = table.index.get(fqn)
        if i is None or type(target) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if table.shape_of(i) != tuple(target.shape) or table.dtype_of(i) != target.dtype:
            return False
        dests[i] = target.detach()
    wanted = set(dests)
    for name, order in table.in_file_order().items():
        mine = [int(j) for j in order if table.c_tensor[int(j)] in wanted]
        if not mine:
            continue
        reads = _direct.VerifiedReads(safe_file(directory, name), verify)
        try:
            for at in range(0, len(mine), DIRECT_BATCH):
                batch = mine[at : at + DIRECT_BATCH]
                _read_batch(reads, table, [(j, dests[table.c_tensor[j]]) for j in batch])
            reads.finish()
        except BaseException:
            reads.abandon()
            raise
    return True


def _read_batch(
    reads: _direct.VerifiedReads, table: Table, pairs: list[tuple[int, torch.Tensor]]
) -> None:
    direct, staged = [], []
    for j, dest in pairs:
        chunk = table.chunk(j)
        part = dest
        if part.dim():
            for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                if (o, n) != (0, part.shape[dim]):
                    part = part.narrow(dim, o, n)
        if _fits(part, part.dtype, chunk.nbytes):
            direct.append((chunk, part))
        else:
            staged.append((chunk, part))
    reads.many(direct)
    for chunk, part in staged:
        part.copy_(reads.new(chunk, part.dtype).view(part.shape))
    reads.check()
