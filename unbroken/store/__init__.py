"""Store layer: the run directory, commit protocol, checksums, scanning, retention, lock."""

from ._async import AsyncSaver
from ._layout import checkpoints_dir, scan, step_name
from ._lock import WriterLock
from ._reader import CheckpointReader
from ._remote import RemoteStore
from ._storage import TensorReader, TensorWriter
from ._store import CheckpointStore, Listing, Retention

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
