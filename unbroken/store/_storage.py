"""Format 2 behind DCP's public storage API: DCP plans (and reshards), we decide the bytes.

:class:`TensorWriter` / :class:`TensorReader` implement ``StorageWriter`` / ``StorageReader``:
each rank writes its chunks into one raw data file (_direct), rank 0 writes the JSON table
(_format), and a load reads each chunk straight into the tensor DCP resolves for it, verifying
its checksum as it goes. Nothing is pickled, and nothing read is ever unpickled.

In one process with plain tensors -- the common case -- save and load skip DCP's planning (a
per-tensor cost that dominates for many small tensors) and produce or consume the very same
files; DTensors, several ranks and resharding go through ``dcp.save`` / ``dcp.load``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ..errors import CorruptCheckpointError, UnbrokenError, root_oserror
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


class TensorWriter(StorageWriter):
    """Writes format 2 into ``directory``; ``records`` gets {file: (size, xxh3)} of this rank."""

    def __init__(self, directory: str, slots: Any = None) -> None:
        super().__init__()
        self.directory = directory
        self.slots = slots
        self.records: dict[str, tuple[int, str]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.records = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator names every rank's data file, as FileSystemWriter assigns prefixes.
        return [
            dataclasses.replace(p, storage_data=_format.data_file(i)) for i, p in enumerate(plans)
        ]

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        name = plan.storage_data
        pairs: list[tuple[Any, torch.Tensor]] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise TypeError(
                    f"{item.index.fqn!r} is not a tensor; unbroken saves objects as JSON state"
                )
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor)
            pairs.append((item, data))
        chunks = _write_file(self.directory, name, pairs, self.records, self.slots)
        results = [
            WriteResult(index=item.index, size_in_bytes=c.nbytes, storage_data=c)
            for (item, _), c in zip(pairs, chunks, strict=True)
        ]
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: dcp_md.Metadata, results: list[list[WriteResult]]) -> None:
        chunks = [r.storage_data for rank in results for r in rank]
        doc = _format.encode(metadata, chunks)
        self.records[_format.TABLE_FILE] = _fsops.write_file(
            os.path.join(self.directory, _format.TABLE_FILE), dumps(doc)
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def storage_meta(self) -> dcp_md.StorageMeta | None:
        return None


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
    writer = TensorWriter(directory, slots)
    with _dcp_call():
        dcp.save(
            dict(tensors), storage_writer=writer, process_group=group, no_dist=not _dist.active()
        )
    return dict(writer.records)


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


@contextmanager
def _dcp_call() -> Iterator[None]:
    """Run a DCP call quietly and re-raise the first underlying error of ours or of the OS.

    DCP wraps every rank's failure in CheckpointException (a BaseException); callers want the
    real ENOSPC or UnsafeCheckpointError, with its path.
    """
    try:
        with warnings.catch_warnings():
            # "assuming the intent is to save in a single process": yes, it is.
            warnings.filterwarnings("ignore", message=".*assuming the intent.*")
            yield
    except CheckpointException as e:
        errors = [exc for exc, _ in e.failures.values()]
        for exc in errors:
            if isinstance(exc, (UnbrokenError, OSError)):
                raise exc from None
        for exc in errors:
            inner = root_oserror(exc)
            if inner is not None:
                raise inner from None
        raise CorruptCheckpointError(f"torch.distributed.checkpoint failed: {e}") from None


# ---- reading ------------------------------------------------------------------------------------


class TensorReader(StorageReader):
    """Reads format 2 for ``dcp.load``; every chunk's checksum is verified as it is read."""

    def __init__(self, directory: str, table: Table, verify: bool = True) -> None:
        super().__init__()
        self.directory, self.table, self.verify = directory, table, verify
        self.storage_data: dict[Any, Chunk] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        return _format.to_metadata(self.table)

    def set_up_storage_reader(
        self, metadata: dcp_md.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            chunk = self.storage_data[item.storage_index]
            per_file.setdefault(chunk.file, []).append((chunk, item))
        for name, items in per_file.items():
            items.sort(key=lambda ci: ci[0].offset)
            reads = _direct.VerifiedReads(self._path(name), self.verify)
            try:
                cached: tuple[Chunk | None, torch.Tensor | None] = (None, None)
                for chunk, item in items:
                    target = planner.resolve_tensor(item).detach()
                    cached = self._fill(reads, chunk, item, target, cached)
                    planner.commit_tensor(item, target)
                reads.finish()
            except BaseException:
                reads.abandon()
                raise
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def _path(self, name: str) -> str:
        return safe_file(self.directory, name)

    def _fill(self, reads: Any, chunk: Chunk, item: Any, target: torch.Tensor, cached: Any) -> Any:
        # By index: table[fqn] would build an Entry of every chunk of the tensor, per chunk.
        dtype = self.table.dtype_of(self.table.index[chunk.fqn])
        whole = not any(item.storage_offsets) and tuple(item.lengths) == chunk.sizes
        if whole and _fits(target, dtype, chunk.nbytes):
            reads.into(chunk, target)
            return (None, None)
        if cached[0] is chunk:
            data = cached[1]
        else:
            data = reads.new(chunk, dtype)  # resharding: one chunk feeds several targets
        part = data
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            part = part.narrow(dim, start, length)
        if part.shape != target.shape:
            raise CorruptCheckpointError(
                f"{reads.path}: tensor {chunk.fqn!r} has shape {list(part.shape)}, the planner "
                f"expected {list(target.shape)}"
            )
        target.copy_(part)
        return (chunk, data)


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
    with _dcp_call():
        dcp.load(
            targets,
            storage_reader=TensorReader(directory, table, verify),
            no_dist=not _dist.active(),
        )


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
