"""The per-step metrics log: ``RUN/metrics.jsonl``, one object per step, resumes marked.

Each checkpoint records the log's byte length; a resume truncates the log there (the steps
after it are about to be redone, identically) and appends ``{"event": "resume", ...}``. So the
log always holds each step exactly once, in order, across any number of interruptions.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch

from .._logfile import METRICS_FILE, read_metrics

__all__ = ["METRICS_FILE", "MetricsLog", "read_metrics"]


class MetricsLog:
    def __init__(self, run_dir: str, resume_offset: int | None) -> None:
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._f = open(self.path, "ab")
        size = self._f.seek(0, os.SEEK_END)
        offset = resume_offset or 0
        if size > offset:
            self._f.truncate(offset)
        self._f.seek(0, os.SEEK_END)
        self.lost = max(offset - size, 0)

    def event(self, kind: str, **fields: Any) -> None:
        self._write({"event": kind, "time": round(time.time(), 3), **fields})

    def step(self, record: dict[str, Any]) -> None:
        self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=True)
        self._f.write(line.encode() + b"\n")
        # Flushed per line so `tail -f` and watchers see each step; durability comes from the
        # checkpoint (which records the length), so no fsync.
        self._f.flush()

    def offset(self) -> int:
        """Flush and return the byte length (recorded in every checkpoint)."""
        self._f.flush()
        return self._f.tell()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self._f.close()


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach()
        return v.item() if v.numel() == 1 else v.tolist()
    if hasattr(v, "item") and callable(v.item) and not isinstance(v, (list, dict, str)):
        try:
            return v.item()
        except (TypeError, ValueError):
            return v
    return v


def is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
