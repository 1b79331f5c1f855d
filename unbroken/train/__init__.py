"""Train layer: the run, its triggers, signals, metrics log and progress display."""

from ._config import RunConfig
from ._metrics import read_metrics
from ._run import Run

__all__ = ["Run", "RunConfig", "read_metrics"]
