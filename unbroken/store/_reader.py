"""Reading one committed checkpoint: manifest, JSON state, tensor metadata, tensors.

Format 2 (what this unbroken writes) reads through _storage, with nothing to unpickle;
format 1 (a pre-release's pickled records) is refused by the manifest check, naming it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CheckpointError, CorruptCheckpointError
from ..state import _nested
from . import _format, _layout, _manifest, _tablefile
from ._table import Table

if TYPE_CHECKING:  # listing and verifying a checkpoint needs no torch (`unbroken ls`)
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
    """A checkpoint directory whose manifest parsed (call :meth:`verify` for checksums).

    Public methods check; the ``_io_*`` hooks read the bytes (a subclass reads them from an
    object store: store/remote/_object_reader.py), so every refusal is the same wherever they are.
    """

    @_located
    def __init__(self, path: str) -> None:
        self.path = path
        self.manifest = self._io_manifest()
        self.step: int = self.manifest["step"]
        named = _layout.parse_step(os.path.basename(os.path.normpath(path)))
        if named is not None and named != self.step:
            raise CorruptCheckpointError(
                f"{path} holds the manifest of step {self.step}; a checkpoint directory "
                "must not be renamed"
            )
        self.format_version: int = self.manifest["format_version"]
        self._infos: Mapping[str, TensorInfo] | None = None
        self._table: Table | None = None

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
        skip = {n for n in self.manifest["files"] if n.startswith("tensors-r")}
        self._io_verify_files(checksums, skip)
        ranks = [_manifest.rank_file(r) for r in range(self.world_size)]
        for name in (_manifest.STATE_FILE, _format.TABLE_FILE, *ranks):
            if name not in self.manifest["files"]:
                raise CorruptCheckpointError(f"{self.path}: manifest does not list {name}")
        # Parse (safely) and validate the tensor metadata too, so that a checkpoint whose
        # checksums match but whose metadata is unsafe or malformed is skipped by latest().
        self.tensor_infos()
        if self._table is not None:
            unlisted = self._table.data_files() - set(self.manifest["files"])
            if unlisted:
                raise CorruptCheckpointError(f"{self.path}: manifest does not list {unlisted}")
            if checksums and data:
                self._io_verify_data(self._table)

    @_located
    def check_contents(self) -> None:
        """Refuse what a restore would refuse, without restoring anything: the global and every
        rank's state file must parse (as JSON, and name only tensors the payload holds), and
        the tensor metadata must validate (format 2: every chunk inside its file, in bounds,
        not overlapping). Reads no tensor data."""
        self.global_trees()
        for rank in range(self.world_size):
            self.local_trees(rank)
        self.tensor_infos()

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
        doc = self._io_json(name)
        where = self._where(name)
        comps = doc.get("components") if isinstance(doc, dict) else None
        if not isinstance(comps, dict):
            raise CorruptCheckpointError(f"{where} has no components")
        infos = self.tensor_infos()
        for comp, tree in comps.items():
            _nested.validate(tree, f"{where}: component {comp!r}")
            for key in _nested.tensor_names(tree):
                if key not in infos:
                    raise CorruptCheckpointError(
                        f"{self.path}: component {comp!r} refers to tensor {key!r}, "
                        "which the tensor payload does not hold"
                    )
        return comps

    @_located
    def tensor_infos(self) -> Mapping[str, TensorInfo]:
        if self._infos is None:
            sizes = {n: int(r["size"]) for n, r in self.manifest["files"].items()}
            self._table = self._io_table(sizes)
            self._infos = self._table.infos()
        return self._infos

    def tensor_table(self) -> Table:
        """The tensor table as read (compact columns: names, dtype names, shapes), for a reader
        of every tensor's description that must not make an object per tensor (``unbroken
        inspect``). Parses it if :meth:`tensor_infos` did not."""
        self.tensor_infos()
        assert self._table is not None
        return self._table

    @_located
    def load_tensors(self, targets: dict[str, torch.Tensor], *, verify: bool = True) -> None:
        """Fill ``targets`` from the payload, verifying every chunk read (``verify``)."""
        self.tensor_infos()
        assert self._table is not None
        self._io_load(self._table, targets, verify)

    def size_bytes(self) -> int:
        return sum(int(r["size"]) for r in self.manifest["files"].values())

    # ---- where the bytes come from (a local directory here) ---------------------------------

    def _where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _io_manifest(self) -> dict[str, Any]:
        return _manifest.read_manifest(self.path)

    def _io_json(self, name: str) -> Any:
        return _manifest.read_json(self.path, name)

    def _io_verify_files(self, checksums: bool, skip: set[str]) -> None:
        _manifest.verify_files(self.path, self.manifest, checksums=checksums, skip=skip)

    def _io_table(self, sizes: dict[str, int]) -> Table:
        return _tablefile.read_table(self.path, sizes)

    def _io_verify_data(self, table: Table) -> None:
        _tablefile.verify_data(self.path, table, self.manifest["files"])

    def _io_load(self, table: Table, targets: dict[str, torch.Tensor], verify: bool) -> None:
        from . import _storage

        _storage.load_tensors(self.path, table, targets, verify)
