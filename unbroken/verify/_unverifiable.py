"""Errors of ``unbroken verify``: the command could not be checked at all.

A difference between the runs is not an error: it is the report's answer.
"""

from __future__ import annotations

from ..errors import UnbrokenError


class VerifyError(UnbrokenError):
    """The check could not be done: the command failed, timed out or wrote no checkpoint."""


class ScriptFailedError(VerifyError):
    """The training command exited with an error (not 0, not 75, not killed by us)."""

    def __init__(self, message: str, returncode: int, log: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.log = log
