"""Train layer: the run, its triggers, signals, metrics log, settings, callbacks and stages."""

from ._config import RunConfig
from ._loop import StepContext
from ._metrics import read_metrics
from ._outputs import export_weights, write_trace
from ._run import Run
from ._settings import (
    Constant,
    EpochTable,
    LinearWarmup,
    Piecewise,
    Settings,
    StepTable,
    WarmupCosine,
)
from ._staging import Change

__all__ = [
    "Change",
    "Constant",
    "EpochTable",
    "LinearWarmup",
    "Piecewise",
    "Run",
    "RunConfig",
    "Settings",
    "StepContext",
    "StepTable",
    "WarmupCosine",
    "export_weights",
    "read_metrics",
    "write_trace",
]
