"""Names inside a run directory; the only place that knows them."""

from __future__ import annotations

import os
import re

CHECKPOINTS = "checkpoints"
STEP_DIGITS = 9
PINNED = ".pinned"
_STEP = re.compile(r"^step-(\d+)$")
# Our transient names: a save in progress, a checkpoint being deleted, one being replaced, and
# the node parts of a snapshot being merged (named by its manifest: parts of one snapshot only).
_TRANSIENT = re.compile(r"^\.(tmp|del|old|part)-step-(\d+)(?:-[0-9a-f]{16})?$")


def step_name(step: int) -> str:
    """The directory name of step N's checkpoint (``step-000000100``)."""
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def transient(name: str) -> tuple[str, int] | None:
    m = _TRANSIENT.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def tmp_name(step: int) -> str:
    return f".tmp-{step_name(step)}"


def del_name(step: int) -> str:
    return f".del-{step_name(step)}"


def old_name(step: int) -> str:
    return f".old-{step_name(step)}"


def part_name(step: int, manifest_checksum: str) -> str:
    return f".part-{step_name(step)}-{manifest_checksum}"


def checkpoints_dir(run_dir: str) -> str:
    """``RUN/checkpoints``, where the committed checkpoints of a run directory live."""
    return os.path.join(run_dir, CHECKPOINTS)


def scan(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every directory named like a checkpoint, newest first."""
    root = checkpoints_dir(run_dir)
    found: list[tuple[int, str]] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for e in entries:
        step = parse_step(e.name)
        if step is not None and e.is_dir(follow_symlinks=False):
            found.append((step, e.path))
    found.sort(reverse=True)
    return found
