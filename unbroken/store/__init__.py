"""Store layer: the run directory, commit protocol, checksums, scanning, retention, lock.

The names are imported lazily: listing and pinning checkpoints (``unbroken ls``, ``pin``) go
through _store, _reader and _manifest only, not the writers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:
    from ._async import AsyncSaver
    from ._layout import checkpoints_dir, scan, step_name
    from ._lock import WriterLock
    from ._reader import CheckpointReader
    from ._storage import TensorReader, TensorWriter
    from ._store import CheckpointStore, Listing, Retention
    from .remote._bucket import RemoteStore

_LAZY = {
    "AsyncSaver": "._async",
    "CheckpointReader": "._reader",
    "CheckpointStore": "._store",
    "Listing": "._store",
    "RemoteStore": ".remote._bucket",
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


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)
