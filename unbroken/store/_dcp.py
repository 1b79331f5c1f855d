"""Format 2 behind DCP's public storage API: DCP plans (and reshards), we decide the bytes.

:class:`TensorWriter` / :class:`TensorReader` implement ``StorageWriter`` / ``StorageReader``
for ``dcp.save`` / ``dcp.load``: DTensors, several ranks, resharding. They write and read the
same files as the direct path of :mod:`._storage`, which imports this module only when it
needs it (DCP imports FSDP and DTensor: ~0.8 s of a process's start).
"""

from __future__ import annotations

import dataclasses
import os
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
from ._storage import _fits, _write_file
from ._table import Table


def write_tensors(
    directory: str, tensors: Mapping[str, torch.Tensor], slots: Any, group: Any
) -> dict[str, tuple[int, str]]:
    """:func:`._storage.write_tensors` through ``dcp.save`` (collective under a process
    group)."""
    from .. import _dist

    writer = TensorWriter(directory, slots)
    with _dcp_call():
        dcp.save(
            dict(tensors), storage_writer=writer, process_group=group, no_dist=not _dist.active()
        )
    return dict(writer.records)


def load_tensors(
    directory: str, table: Table, targets: dict[str, torch.Tensor], verify: bool
) -> None:
    """:func:`._storage.load_tensors` through ``dcp.load``."""
    from .. import _dist

    with _dcp_call():
        dcp.load(
            targets,
            storage_reader=TensorReader(directory, table, verify),
            no_dist=not _dist.active(),
        )


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
