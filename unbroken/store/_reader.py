"""Reading one committed checkpoint: manifest, JSON state, tensor metadata, tensors.

Format 2 (what this unbroken writes) reads through _storage, with nothing to unpickle;
format 1 (unbroken 0.1) through _v1, its restricted unpickler kept for old run directories.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import CheckpointError, CorruptCheckpointError
from . import _format, _layout, _manifest, _table

if TYPE_CHECKING:  # imported where used: verifying and listing (``unbroken ls``) need no torch
    import torch

    from ..state import TensorInfo

F = TypeVar("F", bound=Callable[..., Any])


def _located(method: F) -> F:
    """A checkpoint error raised while reading says which checkpoint: ``path`` (the file, if
    the raiser named one, else the checkpoint directory) and ``step`` are filled in."""

    @functools.wraps(method)
    def wrapper(self: CheckpointReader, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except CheckpointError as e:
            if e.path is None:
                e.path = self.path
            if e.step is None:
                e.step = getattr(self, "step", None)
            raise

    return wrapper  # type: ignore[return-value]


class CheckpointReader:
    """A checkpoint directory whose manifest parsed (call :meth:`verify` for checksums)."""

    @_located
    def __init__(self, path: str) -> None:
        self.path = path
        self.manifest = _manifest.read_manifest(path)
        self.step: int = self.manifest["step"]
        named = _layout.parse_step(os.path.basename(os.path.normpath(path)))
        if named is not None and named != self.step:
            raise CorruptCheckpointError(
                f"{path} holds the manifest of step {self.step}; a checkpoint directory "
                "must not be renamed"
            )
        self.format_version: int = self.manifest["format_version"]
        self._infos: dict[str, TensorInfo] | None = None
        self._metadata: Any = None  # format 1: DCP metadata
        self._table: dict[str, _format.Entry] | None = None  # format 2

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def components(self) -> dict[str, Any]:
        return dict(self.manifest["components"])

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.manifest.get("meta") or {})

    @_located
    def verify(self, *, checksums: bool = True, data: bool = True) -> None:
        """Check every file's size and (``checksums``) checksum, and parse the tensor metadata.
        ``data=False`` leaves format 2 data files to the load, which verifies each chunk as
        it reads it (a corrupt one then fails the load, naming the tensor)."""
        skip: set[str] = set()
        if self.format_version >= 2:
            skip = {n for n in self.manifest["files"] if n.startswith("tensors-r")}
        _manifest.verify_files(self.path, self.manifest, checksums=checksums, skip=skip)
        ranks = [_manifest.rank_file(r) for r in range(self.world_size)]
        payload = ".metadata" if self.format_version == 1 else _format.TABLE_FILE
        for name in (_manifest.STATE_FILE, payload, *ranks):
            if name not in self.manifest["files"]:
                raise CorruptCheckpointError(f"{self.path}: manifest does not list {name}")
        # Parse (safely) and validate the tensor metadata too, so that a checkpoint whose
        # checksums match but whose metadata is unsafe or malformed is skipped by latest().
        if self.format_version == 1:
            self.tensor_infos()
            return
        table = self._read_table()
        unlisted = _format.data_files(table) - set(self.manifest["files"])
        if unlisted:
            raise CorruptCheckpointError(f"{self.path}: manifest does not list {unlisted}")
        if checksums and data:
            _table.verify_data(self.path, table, self.manifest["files"])

    @_located
    def check_contents(self) -> None:
        """Refuse what a restore would refuse, without restoring anything: the global and every
        rank's state file must parse (as JSON, and name only tensors the payload holds), and
        the tensor metadata must validate (format 2: every chunk inside its file, in bounds,
        not overlapping; format 1: every record's header parsed and matching the metadata).
        Reads no tensor data."""
        self.global_trees()
        for rank in range(self.world_size):
            self.local_trees(rank)
        self.tensor_names()
        if self.format_version == 1:
            from . import _v1

            _v1.check_records(self.path, self._metadata)

    @_located
    def global_trees(self) -> dict[str, Any]:
        return self._trees(_manifest.STATE_FILE)

    @_located
    def local_trees(self, rank: int) -> dict[str, Any] | None:
        """Rank-local state of ``rank``, or None if that rank did not exist when saved."""
        name = _manifest.rank_file(rank)
        if name not in self.manifest["files"]:
            return None
        return self._trees(name)

    def _trees(self, name: str) -> dict[str, Any]:
        from ..state import _tree

        doc = _manifest.read_json(self.path, name)
        comps = doc.get("components") if isinstance(doc, dict) else None
        if not isinstance(comps, dict):
            raise CorruptCheckpointError(f"{os.path.join(self.path, name)} has no components")
        infos = self.tensor_names()
        where = os.path.join(self.path, name)
        for comp, tree in comps.items():
            _tree.validate(tree, f"{where}: component {comp!r}")
            for key in _tree.tensor_names(tree):
                if key not in infos:
                    raise CorruptCheckpointError(
                        f"{self.path}: component {comp!r} refers to tensor {key!r}, "
                        "which the tensor payload does not hold"
                    )
        return comps

    @_located
    def tensor_infos(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            from ..state import TensorInfo

            if self.format_version == 1:
                from . import _v1

                self._metadata = _v1.read_metadata(self.path)
                self._infos = _v1.tensor_infos(self._metadata)
            else:
                table = self._read_table()
                self._infos = {k: TensorInfo(e.shape, e.dtype) for k, e in table.items()}
        return self._infos

    def tensor_names(self) -> set[str]:
        """The saved tensors' names (format 2: from the table, without torch)."""
        if self.format_version == 1:
            return set(self.tensor_infos())
        return set(self._read_table())

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each saved tensor's shape and dtype name ("float32"); format 2 needs no torch."""
        if self.format_version == 1:
            return {
                k: (tuple(i.shape), str(i.dtype).removeprefix("torch."))
                for k, i in self.tensor_infos().items()
            }
        return {k: (e.shape, e.dtype_name) for k, e in self._read_table().items()}

    def _read_table(self) -> dict[str, _format.Entry]:
        """Format 2: the parsed and validated tensor table (no torch needed)."""
        if self._table is None:
            sizes = {n: int(r["size"]) for n, r in self.manifest["files"].items()}
            self._table = _table.read_table(self.path, sizes)
        return self._table

    @_located
    def load_tensors(self, targets: dict[str, torch.Tensor], *, verify: bool = True) -> None:
        """Fill ``targets`` from the payload; format 2 verifies every chunk read (``verify``)."""
        self.tensor_infos()
        if self._table is not None:
            from . import _storage

            _storage.load_tensors(self.path, self._table, targets, verify)
        else:
            from . import _v1

            _v1.load_tensors(self.path, targets, self._metadata)

    def size_bytes(self) -> int:
        return sum(int(r["size"]) for r in self.manifest["files"].values())
