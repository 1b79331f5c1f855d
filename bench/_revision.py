"""The library as it was at an earlier git revision, for benches that compare before and after."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def library_at(revision: str, dest: Path) -> Path:
    """Extract ``unbroken/`` at ``revision`` into ``dest`` (created); returns ``dest``, a
    directory to put first on ``PYTHONPATH``."""
    dest.mkdir()
    archive = subprocess.run(
        ["git", "archive", revision, "unbroken"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest
