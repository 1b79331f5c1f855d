"""Reading one committed checkpoint: manifest, JSON state, tensor metadata, tensors."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._errors import CorruptCheckpointError
from ..state import TensorInfo, _tree
from . import _dcpio, _layout, _manifest


class CheckpointReader:
    """A checkpoint directory whose manifest parsed (call :meth:`verify` for checksums)."""

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
        self._infos: dict[str, TensorInfo] | None = None
        self._metadata: Any = None

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def components(self) -> dict[str, Any]:
        return dict(self.manifest["components"])

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.manifest.get("meta") or {})

    def verify(self, *, checksums: bool = True) -> None:
        _manifest.verify_files(self.path, self.manifest, checksums=checksums)
        ranks = [_manifest.rank_file(r) for r in range(self.world_size)]
        for name in (_manifest.STATE_FILE, ".metadata", *ranks):
            if name not in self.manifest["files"]:
                raise CorruptCheckpointError(f"{self.path}: manifest does not list {name}")
        # Parse (safely) and validate the tensor metadata too, so that a checkpoint whose
        # checksums match but whose metadata is unsafe or malformed is skipped by latest().
        self.tensor_infos()

    def check_contents(self) -> None:
        """Refuse what a restore would refuse, without restoring anything: the global and every
        rank's state file must parse (as JSON, and name only tensors the payload holds), and
        every tensor record must describe a plain tensor (its pickle read by the layout-only
        unpickler). Reads the records' headers, not their data."""
        self.global_trees()
        for rank in range(self.world_size):
            self.local_trees(rank)
        self.tensor_infos()
        _dcpio.check_records(self.path, self._metadata)

    def global_trees(self) -> dict[str, Any]:
        return self._trees(_manifest.STATE_FILE)

    def local_trees(self, rank: int) -> dict[str, Any] | None:
        """Rank-local state of ``rank``, or None if that rank did not exist when saved."""
        name = _manifest.rank_file(rank)
        if name not in self.manifest["files"]:
            return None
        return self._trees(name)

    def _trees(self, name: str) -> dict[str, Any]:
        doc = _manifest.read_json(self.path, name)
        comps = doc.get("components") if isinstance(doc, dict) else None
        if not isinstance(comps, dict):
            raise CorruptCheckpointError(f"{os.path.join(self.path, name)} has no components")
        infos = self.tensor_infos()
        for comp, tree in comps.items():
            for key in _tree.tensor_names(tree):
                if key not in infos:
                    raise CorruptCheckpointError(
                        f"{self.path}: component {comp!r} refers to tensor {key!r}, "
                        "which the tensor payload does not hold"
                    )
        return comps

    def tensor_infos(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            self._metadata = _dcpio.read_metadata(self.path)
            self._infos = _dcpio.tensor_infos(self._metadata)
        return self._infos

    def load_tensors(self, targets: dict[str, torch.Tensor]) -> None:
        _dcpio.load_tensors(self.path, targets, self._metadata)

    def size_bytes(self) -> int:
        return sum(int(r["size"]) for r in self.manifest["files"].values())
