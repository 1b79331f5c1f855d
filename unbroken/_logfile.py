"""Reading ``RUN/metrics.jsonl`` (written by the run; read by verify, the demo and users).

Kept free of torch so the command-line tools can watch a run without importing it.
"""

from __future__ import annotations

import json
import os
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | os.PathLike[str], *, events: bool = False) -> list[dict[str, Any]]:
    """The step records of a run's metrics log, in order (``events=True`` keeps resume marks)."""
    out = []
    with open(os.path.join(run_dir, METRICS_FILE), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if events or "event" not in rec:
                out.append(rec)
    return out


def last_logged_step(run_dir: str | os.PathLike[str]) -> int:
    """The step of the last complete step record of a live log (0 if none yet)."""
    path = os.path.join(run_dir, METRICS_FILE)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 8192))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(rec, dict) and "event" not in rec and isinstance(rec.get("step"), int):
            return int(rec["step"])
    return 0
