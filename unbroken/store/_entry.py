"""What a tier holds, as its listing says: one :class:`Entry` per checkpoint.

Each tier lists its checkpoints without reading them (a directory scan, one object listing, the
names in the snapshot area) and verifies one entry at a time, from its metadata, when the choice
of the resume needs its verdict (train/_choice.py): so a resume reads the metadata of as many
checkpoints as walking each tier newest first did.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LOCAL = "local"
"""The run directory (``RUN/checkpoints``)."""
REMOTE = "remote"
"""The object store of ``remote=``."""
SNAPSHOT = "snapshot"
"""The in-memory snapshot area (under ``unbroken run``)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One checkpoint of one tier."""

    step: int
    tier: str
    where: str
    """Its directory, or its URL in the object store."""
    ok: bool | None = None
    """Whether it verifies (from its metadata); None: not verified yet."""
    why: str = ""
    """Why it cannot be used (``ok`` False): the verification's error, or a failed load."""

    def verified(self) -> Entry:
        return replace(self, ok=True, why="")

    def unusable(self, why: str) -> Entry:
        return replace(self, ok=False, why=why)
