"""Reading format 1 (unbroken 0.1's checkpoints), kept so that old run directories resume.

Format 1 is DCP's own ``FileSystemWriter`` layout: a pickled ``.metadata`` and ``torch.save``
zip records in ``.distcp`` files. unbroken no longer writes it (format 2: _format, _storage)
and this module is only reached for a manifest of format version 1.

DCP's stock reader unpickles ``.metadata`` with plain ``pickle.load`` and would
``torch.load(weights_only=False)`` any byte item. :class:`SafeReader` unpickles the metadata
with an allowlist of DCP's metadata classes, validates every path, offset and length before
reading or allocating, refuses byte items, and reads each tensor record with _fastread: its zip
directory parsed by hand, its ``data.pkl`` by an unpickler that only records the tensor layout
(no ``torch.load``).
"""

from __future__ import annotations

import enum
import os
import pickle
from pathlib import PosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from .._errors import CorruptCheckpointError, UnsafeCheckpointError
from ..state import TensorInfo
from . import _v1records as _fastread
from ._safeio import safe_file

MAX_METADATA_BYTES = 256 << 20

_MD_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}


# ---- reading ------------------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP's metadata is made of; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _MD_CLASSES:
            return getattr(dcp_md, name)
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            return _StorageInfo
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "Path"):
            return PosixPath
        if (module, name) in (("builtins", "getattr"), ("__builtin__", "getattr")):
            # CPython 3.11.0-3.11.4 pickled an Enum member as getattr(cls, name) (gh-103116):
            # resolved only for an Enum class this allowlist admitted, and a member name.
            return _enum_member
        raise UnsafeCheckpointError(
            f"DCP metadata refers to {module}.{name}, which is not a DCP metadata class; "
            "the file may have been crafted to run code and is not loaded"
        )


def _enum_member(cls: Any, name: Any) -> Any:
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == dcp_md.__name__:
        if isinstance(name, str) and name in cls.__members__:
            return cls.__members__[name]
    raise UnsafeCheckpointError(
        f"DCP metadata calls getattr({cls!r}, {name!r}); only an Enum member of DCP's metadata "
        "is allowed there, so the file is not loaded"
    )


def read_metadata(directory: str) -> dcp_md.Metadata:
    """Unpickle and validate DCP's ``.metadata`` of ``directory`` without running code."""
    path = safe_file(directory, ".metadata")
    size = os.path.getsize(path)
    if size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{path} is {size} bytes, more than any metadata should be")
    with open(path, "rb") as f:
        try:
            md = _MetadataUnpickler(f).load()
        except UnsafeCheckpointError as e:
            raise UnsafeCheckpointError(f"{path}: {e}") from None
        except Exception as e:
            raise CorruptCheckpointError(f"{path} cannot be parsed: {e}") from None
    try:
        _validate_metadata(md, directory)
    except (AttributeError, TypeError, ValueError, OverflowError) as e:
        # Consistent (checksums fixed up) but not DCP's shape: e.g. properties=None.
        raise CorruptCheckpointError(f"{path} is malformed DCP metadata: {e}") from None
    return md


def _validate_metadata(md: Any, directory: str) -> None:
    where = os.path.join(directory, ".metadata")
    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{where} does not hold DCP metadata")
    sizes: dict[str, int] = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: a key is not a string")
        if isinstance(tmd, dcp_md.TensorStorageMetadata):
            shape = tuple(tmd.size)
            if any(not isinstance(s, int) or s < 0 for s in shape):
                raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has shape {list(shape)}")
            if not isinstance(tmd.properties.dtype, torch.dtype):
                raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has no valid dtype")
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{where}: storage_data is missing")
    for idx, info in storage.items():
        if not isinstance(idx, dcp_md.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{where}: malformed storage entry")
        if not isinstance(info.offset, int) or not isinstance(info.length, int):
            raise CorruptCheckpointError(f"{where}: non-integer offset for {idx.fqn!r}")
        if info.offset < 0 or info.length < 0:
            raise CorruptCheckpointError(f"{where}: negative offset for {idx.fqn!r}")
        transforms = getattr(info, "transform_descriptors", None)  # a field from torch 2.8
        if transforms:
            raise UnsafeCheckpointError(
                f"{where}: tensor {idx.fqn!r} uses stream transforms "
                f"{list(transforms)}, which unbroken does not read"
            )
        name = info.relative_path
        if not isinstance(name, str):
            raise CorruptCheckpointError(f"{where}: non-string file name for {idx.fqn!r}")
        if name not in sizes:
            sizes[name] = os.lstat(safe_file(directory, name)).st_size
        if info.offset + info.length > sizes[name]:
            raise CorruptCheckpointError(
                f"{where}: tensor {idx.fqn!r} lies at bytes {info.offset}..."
                f"{info.offset + info.length} but {name} has only {sizes[name]} bytes"
            )
    total = sum(sizes.values())
    for fqn, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, dcp_md.TensorStorageMetadata):
            nbytes = _numel(tuple(tmd.size)) * _itemsize(tmd.properties.dtype)
            if nbytes > total:
                raise CorruptCheckpointError(
                    f"{where}: tensor {fqn!r} claims {nbytes} bytes but the data files hold "
                    f"{total}; refusing to allocate it"
                )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def tensor_infos(md: dcp_md.Metadata) -> dict[str, TensorInfo]:
    return {
        k: TensorInfo(tuple(v.size), v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, dcp_md.TensorStorageMetadata)
    }


class SafeReader(dcp.FileSystemReader):
    """A DCP reader that never runs code from the checkpoint (see the module docstring)."""

    def __init__(self, path: str, metadata: dcp_md.Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        md = self._metadata if self._metadata is not None else read_metadata(str(self.path))
        md.storage_meta = dcp_md.StorageMeta(load_id=self.load_id)
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        directory = str(self.path)
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise UnsafeCheckpointError(
                    f"{directory}: item {item.storage_index.fqn!r} is a pickled object; "
                    "unbroken loads only tensors through DCP"
                )
            info: _StorageInfo = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(item)
        for name, items in per_file.items():
            path = safe_file(directory, name)
            items.sort(key=lambda it: self.storage_data[it.storage_index].offset)
            with open(path, "rb", buffering=0) as f:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    target = planner.resolve_tensor(item).detach()
                    where = f"{path}: tensor {item.storage_index.fqn!r}"
                    _fill(f, info, target, item.storage_offsets, item.lengths, where)
                    planner.commit_tensor(item, target)
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut


def _fill(
    f: Any, info: _StorageInfo, target: torch.Tensor, offsets: Any, lengths: Any, where: str
) -> None:
    """Copy the part (``offsets``, ``lengths``) of the record ``info`` of ``f`` into ``target``."""
    rec = _fastread.locate(f, info.offset, info.length, where)
    whole = all(o == 0 for o in offsets) and tuple(lengths) == rec.size
    if whole and _fits(rec, target):
        # The common case: one copy, from the file straight into the tensor.
        if target.numel():
            _fastread.read_into(f, rec, target, where)
        return
    tensor = _narrow(_fastread.read_tensor(f, rec, where), offsets, lengths)
    if target.size() != tensor.size() or target.dtype != tensor.dtype:
        raise CorruptCheckpointError(
            f"{where} has shape {list(tensor.size())} {tensor.dtype}, "
            f"expected {list(target.size())} {target.dtype}"
        )
    target.copy_(tensor)


def _fits(rec: _fastread.Record, target: torch.Tensor) -> bool:
    return (
        rec.contiguous
        and target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == rec.dtype
        and target.numel() * target.element_size() == rec.nbytes
    )


def _narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != t.size(dim):
            t = t.narrow(dim, start, length)
    return t


def load_tensors(
    directory: str, targets: dict[str, torch.Tensor], metadata: dcp_md.Metadata | None = None
) -> None:
    """Fill ``targets`` (name -> preallocated tensor) from the DCP payload in ``directory``.

    ``metadata``: the directory's metadata if it was read already (by :func:`read_metadata`).
    """
    from .. import _dist

    if not targets:
        return
    if not _dist.active():
        md = metadata if metadata is not None else read_metadata(directory)
        if _load_direct(directory, md, targets):
            return
        metadata = md
    from ._storage import _dcp_call

    with _dcp_call():
        dcp.load(
            targets,
            storage_reader=SafeReader(directory, metadata),
            no_dist=not _dist.active(),
        )


def check_records(directory: str, md: dcp_md.Metadata) -> None:
    """Parse every tensor record's description as a load would, reading no tensor data: an
    unsafe or malformed record raises, naming its file and tensor."""
    per_file: dict[str, list[tuple[Any, _StorageInfo]]] = {}
    for idx, info in md.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((idx, info))
    for name, entries in per_file.items():
        path = safe_file(directory, name)
        with open(path, "rb", buffering=0) as f:
            for idx, info in sorted(entries, key=lambda e: e[1].offset):
                where = f"{path}: tensor {idx.fqn!r}"
                rec = _fastread.locate(f, info.offset, info.length, where)
                _check_record(md, idx, rec, where)


def _check_record(md: dcp_md.Metadata, idx: Any, rec: _fastread.Record, where: str) -> None:
    """A record must be the chunk the metadata describes: the load would refuse it otherwise."""
    tmd = md.state_dict_metadata.get(idx.fqn)
    if not isinstance(tmd, dcp_md.TensorStorageMetadata):
        raise CorruptCheckpointError(f"{where}: the metadata has no tensor of that name")
    chunk = next((c for c in tmd.chunks if tuple(c.offsets) == tuple(idx.offset or ())), None)
    if chunk is None and len(tmd.chunks) == 1:
        chunk = tmd.chunks[0]
    if chunk is None or tuple(chunk.sizes) != rec.size or tmd.properties.dtype != rec.dtype:
        raise CorruptCheckpointError(
            f"{where}: the record holds {list(rec.size)} {rec.dtype}, the metadata describes "
            f"{list(chunk.sizes) if chunk else '?'} {tmd.properties.dtype}"
        )


def _load_direct(directory: str, md: dcp_md.Metadata, targets: dict[str, torch.Tensor]) -> bool:
    """In one process, when every target is a plain CPU tensor saved whole (one chunk) with
    its shape and dtype, read the records straight into the targets without DCP's planning
    (a per-tensor cost that dominates for many tensors). Returns False, having read nothing,
    for anything else (DTensors, resharding, a missing key, a shape or dtype to convert):
    DCP handles (or reports) those."""
    per_file: dict[str, list[tuple[int, _StorageInfo, str, torch.Tensor]]] = {}
    for fqn, target in targets.items():
        tmd = md.state_dict_metadata.get(fqn)
        if not isinstance(tmd, dcp_md.TensorStorageMetadata) or len(tmd.chunks) != 1:
            return False
        if type(target) not in (torch.Tensor, torch.nn.Parameter) or target.device.type != "cpu":
            return False
        shape = tuple(target.shape)
        chunk = tmd.chunks[0]
        if tuple(tmd.size) != shape or tmd.properties.dtype != target.dtype:
            return False
        if any(chunk.offsets) or tuple(chunk.sizes) != shape:
            return False
        info = md.storage_data.get(dcp_md.MetadataIndex(fqn, chunk.offsets))
        if not isinstance(info, _StorageInfo):
            return False
        per_file.setdefault(info.relative_path, []).append((info.offset, info, fqn, target))
    for name, entries in per_file.items():
        path = safe_file(directory, name)
        entries.sort(key=lambda e: e[0])
        with open(path, "rb", buffering=0) as f:
            for _, info, fqn, target in entries:
                t = target.detach()
                _fill(f, info, t, [0] * t.dim(), t.shape, f"{path}: tensor {fqn!r}")
    return True
