"""Exceptions raised by unbroken: ``from unbroken.errors import ...`` (the common ones are
also at the top level: ``unbroken.ConfigError``).

Every user-facing failure is a subclass of :class:`UnbrokenError` and says what happened,
to which path or component, and what to do next::

    UnbrokenError
    ├── ConfigError (also ValueError)        a bad argument or option
    │   └── ConfigTypeError (also TypeError)  an option of the wrong type
    ├── StateError                           tracked state and checkpoint disagree
    ├── DataError                            a loader cannot continue its saved position
    ├── LockError                            another process writes this run directory
    ├── CollectiveTimeoutError               a rank did not answer a collective in time
    └── CheckpointError
        ├── CheckpointNotFoundError          no (valid) checkpoint where one was required
        ├── CorruptCheckpointError           size, checksum, file set or manifest is wrong
        ├── UnsafeCheckpointError            a file would execute code or escapes the directory
        ├── CheckpointWriteError             a write failed (ENOSPC, EIO, EACCES, EROFS, ...)
        └── RemoteStoreError                 an object store refused or could not be reached

    ResumeWarning (a UserWarning)            the script would resume inexactly, as written

Every error carries ``path`` and ``step`` where known (else None); checkpoint errors also
``errno`` and ``filename`` (an alias of ``path``, as on ``OSError``): a write error's are
those of the innermost ``OSError`` behind it (:func:`root_oserror`), so a full disk reads as
ENOSPC on the file being written.
"""

from __future__ import annotations

import errno
from typing import Any

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ConfigTypeError",
    "CorruptCheckpointError",
    "DataError",
    "LockError",
    "RemoteStoreError",
    "ResumeWarning",
    "StateError",
    "UnbrokenError",
    "UnsafeCheckpointError",
]


class UnbrokenError(Exception):
    """Base class of every error unbroken raises on purpose. ``path`` and ``step`` name the
    file or directory and the checkpoint step it concerns, where known (else None)."""

    path: str | None = None
    step: int | None = None

    def __init__(self, *args: Any, path: str | None = None, step: int | None = None) -> None:
        super().__init__(*args)
        self.path = path
        self.step = step


class ConfigError(UnbrokenError, ValueError):
    """An argument or option is invalid; the message names it."""


class ConfigTypeError(ConfigError, TypeError):
    """An option or argument has the wrong type (``save_every="10"``); the message names the
    option and the type it takes."""


class StateError(UnbrokenError):
    """The tracked components and a checkpoint disagree (missing, unexpected, reshaped)."""


class ResumeWarning(UserWarning):
    """The script does something that makes a resumed run diverge from an uninterrupted one
    (a parameter no tracked module owns, random draws between ``Run()`` and the loop); the
    message names it and the fix. ``warnings.simplefilter("error", unbroken.ResumeWarning)``
    turns every such finding into an exception."""


class DataError(UnbrokenError):
    """A loader's saved position does not fit the dataset it is asked to continue."""


class CollectiveTimeoutError(UnbrokenError):
    """A collective unbroken issued (stop agreement, commit, resume choice) did not complete
    in time, or a rank it waited for stopped beating (dead, or its node lost); ``missing``
    holds the ranks that did not answer, where known."""

    def __init__(self, *args: Any, missing: list[int] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.missing = missing


class LockError(UnbrokenError):
    """Another live process holds the writer lock of the run directory."""


class CheckpointError(UnbrokenError):
    """Base class of checkpoint read/write failures."""

    def __init__(
        self,
        *args: Any,
        errno: int | None = None,
        path: str | None = None,
        step: int | None = None,
    ) -> None:
        super().__init__(*args, path=path, step=step)
        self.errno = errno

    @property
    def filename(self) -> str | None:
        return self.path


class CheckpointNotFoundError(CheckpointError):
    """No valid checkpoint was found where one was required."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint is incomplete or damaged; the message names the file."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would run code on load, or points outside its directory."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint (or the run's lock or metrics log) failed; the previous checkpoint
    is intact."""


class RemoteStoreError(CheckpointError):
    """An object store (``s3://...``) could not be reached or refused a request: wrong
    credentials, a missing bucket, an unreachable endpoint, retries exhausted. The message names
    the URL, the endpoint and the cause; ``path`` is the URL concerned."""


def root_oserror(exc: BaseException | None) -> OSError | None:
    """The innermost ``OSError`` behind ``exc``: followed through ``__cause__``,
    ``__context__`` and the per-rank ``failures`` of DCP's ``CheckpointException``.

    A full disk mid-write surfaces as whatever the writer raised while unwinding (torch's zip
    writer: ``RuntimeError: unexpected pos ...``); the ENOSPC survives only in the chain. The
    deepest OSError that has an errno and a file name wins (one without an errno is a wrapper's
    message; one without a file name, e.g. from ``pwrite``, is less useful than its wrapper).
    """
    best: tuple[int, int, int, OSError] | None = None  # (has errno, has file, depth, error)
    stack: list[tuple[BaseException, int]] = [(exc, 0)] if exc is not None else []
    seen: set[int] = set()
    while stack:
        e, depth = stack.pop()
        if id(e) in seen or depth > 64:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            rank = (int(e.errno is not None), int(e.filename is not None), depth)
            if best is None or rank > best[:3]:
                best = (*rank, e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                inner = value[0] if isinstance(value, tuple) and value else value
                if isinstance(inner, BaseException):
                    stack.append((inner, depth + 1))
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                stack.append((nxt, depth + 1))
    return best[3] if best is not None else None


def write_error(err: BaseException, tmp: str, step: int, root: str) -> BaseException:
    """What a failed save raises: the innermost OSError behind ``err`` (a full disk mid-write
    surfaces as torch's "unexpected pos" with the ENOSPC only in its chain), as a
    CheckpointWriteError with that errno and file; an error of ours without one as it is."""
    os_err = root_oserror(err)
    # Ours, and not a wrapper of an OS error (DCP's failures arrive as CorruptCheckpointError):
    # as it is. An UnsafeCheckpointError (say) stays one even if an OSError preceded it.
    wrapper = isinstance(err, CorruptCheckpointError)
    ours = isinstance(err, UnbrokenError) and not wrapper
    if isinstance(err, CheckpointWriteError) or ours or (wrapper and os_err is None):
        if isinstance(err, CheckpointError) and err.step is None:
            err.step = step
        return err
    if os_err is not None:
        where = os_err.filename or tmp
        what = f"[Errno {os_err.errno}] {os_err.strerror}"
        if os_err.errno == errno.ENOSPC:
            what += " (the disk is full: free space or point the run at another disk)"
    else:
        where, what = tmp, f"{type(err).__name__}: {err}"
    return CheckpointWriteError(
        f"could not save step {step}: writing {where} failed: {what}; nothing was committed, "
        f"earlier checkpoints in {root} are intact",
        errno=os_err.errno if os_err is not None else None,
        path=str(where),
        step=step,
    )
