"""Store layer: the run directory, commit protocol, checksums, scanning, retention, lock.

The names are imported lazily: listing and pinning checkpoints (``unbroken ls``, ``pin``) go
through _store, _reader, _table and _manifest only, and never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._async import AsyncSaver
    from ._layout import checkpoints_dir, scan, step_name
    from ._lock import WriterLock
    from ._reader import CheckpointReader
    from ._remote import RemoteStore
    from ._storage import TensorReader, TensorWriter
    from ._store import CheckpointStore, Listing, Retention

_LAZY = {
    "AsyncSaver": "._async",
    "CheckpointReader": "._reader",
    "CheckpointStore": "._store",
    "Listing": "._store",
    "RemoteStore": "._remote",
    "Retention": "._store",
    "TensorReader": "._storage",
    "TensorWriter": "._storage",
    "WriterLock": "._lock",
    "checkpoints_dir": "._layout",
    "scan": "._layout",
    "step_name": "._layout",
}

__all__ = [
    "AsyncSaver",
    "CheckpointReader",
    "CheckpointStore",
    "Listing",
    "RemoteStore",
    "Retention",
    "TensorReader",
    "TensorWriter",
    "WriterLock",
    "checkpoints_dir",
    "scan",
    "step_name",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
