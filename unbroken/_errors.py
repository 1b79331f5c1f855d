"""Exceptions raised by unbroken.

Every user-facing failure is a subclass of :class:`UnbrokenError` and says what happened,
to which path or component, and what to do next::

    UnbrokenError
    ├── ConfigError (also ValueError)        a bad argument or option
    ├── StateError                           tracked state and checkpoint disagree
    ├── DataError                            a loader cannot continue its saved position
    ├── LockError                            another process writes this run directory
    └── CheckpointError
        ├── CheckpointNotFoundError          no (valid) checkpoint where one was required
        ├── CorruptCheckpointError           size, checksum, file set or manifest is wrong
        ├── UnsafeCheckpointError            a file would execute code or escapes the directory
        └── CheckpointWriteError             the save failed (ENOSPC, EIO, EACCES, EROFS, ...)
"""

from __future__ import annotations


class UnbrokenError(Exception):
    """Base class of every error unbroken raises on purpose."""


class ConfigError(UnbrokenError, ValueError):
    """An argument or option is invalid; the message names it."""


class StateError(UnbrokenError):
    """The tracked components and a checkpoint disagree (missing, unexpected, reshaped)."""


class DataError(UnbrokenError):
    """A loader's saved position does not fit the dataset it is asked to continue."""


class LockError(UnbrokenError):
    """Another live process holds the writer lock of the run directory."""


class CheckpointError(UnbrokenError):
    """Base class of checkpoint read/write failures."""


class CheckpointNotFoundError(CheckpointError):
    """No valid checkpoint was found where one was required."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint is incomplete or damaged; the message names the file."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would run code on load, or points outside its directory."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; the previous checkpoint is intact."""
