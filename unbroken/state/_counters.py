"""The loop's own position, tracked like any other component (torchtitan's ``train_state``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import StateError

COUNTERS_VERSION = 1


@dataclass(slots=True)
class Counters:
    """Where the run stands; saved with every checkpoint."""

    kind = "counters"

    step: int = 0
    """Optimizer steps completed."""
    epoch: int = 0
    """Epochs completed (the epoch in progress when a step runs)."""
    samples: int = 0
    """Samples consumed, summed over every step (global, all ranks)."""
    train_seconds: float = 0.0
    """Wall time spent training, summed over every resume."""
    metrics_offset: int = 0
    """Byte length of the metrics log at this step; resume truncates the log to it."""
    complete: bool = False
    """Training finished; relaunching the command does no more steps."""
    stage: Any = None
    """Whatever the model factory needs to rebuild the model of this stage (staged training)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Settings set by callbacks (unlike schedules, they are state)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """User-visible values to keep with the counters."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": COUNTERS_VERSION,
            "step": self.step,
            "epoch": self.epoch,
            "samples": self.samples,
            "train_seconds": self.train_seconds,
            "metrics_offset": self.metrics_offset,
            "complete": self.complete,
            "stage": self.stage,
            "overrides": dict(self.overrides),
            "extra": dict(self.extra),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != COUNTERS_VERSION:
            raise StateError(
                f"counters have version {state_dict.get('version')!r}, expected {COUNTERS_VERSION}"
            )
        self.step = int(state_dict["step"])
        self.epoch = int(state_dict["epoch"])
        self.samples = int(state_dict["samples"])
        self.train_seconds = float(state_dict["train_seconds"])
        self.metrics_offset = int(state_dict["metrics_offset"])
        self.complete = bool(state_dict["complete"])
        self.stage = state_dict.get("stage")
        self.overrides = dict(state_dict.get("overrides") or {})
        self.extra = dict(state_dict.get("extra") or {})
