"""Train layer: the run, its triggers, signals, metrics log, settings, callbacks and stages.

The run's own names (``Run``, ``RunConfig``, ``StepContext``, ``export_weights``,
``read_metrics``, ``make_deterministic``) are also at the top level (``unbroken.Run``); the
settings and their schedules (``Settings``, ``WarmupCosine``, ...), ``Change``,
``CanonicalGradients``, ``determinism_problems`` and ``write_trace`` are imported from here.
"""

from .. import _lazy
from ._canonical import CanonicalGradients
from ._config import RunConfig
from ._determinism import determinism_problems, make_deterministic
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
    "CanonicalGradients",
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
    "determinism_problems",
    "export_weights",
    "make_deterministic",
    "read_metrics",
    "write_trace",
]

# Renamed: "Shards" also named a loader (unbroken.data.IterableShards) and a dataset
# (unbroken.data.JsonlShards); this one is a way of computing gradients.
_DEPRECATED = {"CanonicalShards": "unbroken.train.CanonicalGradients"}

__getattr__, __dir__ = _lazy.exports(__name__, {}, _DEPRECATED)
