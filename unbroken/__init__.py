"""unbroken: stop a PyTorch training run anywhere; relaunch; it continues bit for bit.

The top level holds what a training script needs (``Run``, its loaders, seeding, the errors
a script catches); the rest lives in its package: ``unbroken.train`` (settings and their
schedules, ``Change``, ``CanonicalGradients``), ``unbroken.data`` (every loader, vocabularies,
shards, corpora), ``unbroken.integrations`` (Lightning, transformers, Accelerate, TensorBoard,
W&B), ``unbroken.verify``, ``unbroken.store`` and ``unbroken.errors`` (every error). See
docs/api.md.

The public names are imported lazily, so that ``import unbroken`` (and the ``unbroken``
command, e.g. the supervisor) does not pay for importing torch until it is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _lazy
from ._version import __version__
from .errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DataError,
    LockError,
    ResumeWarning,
    StateError,
    UnbrokenError,
)
from .process import _quick_exit, _stops
from .process._exit import EXIT_RESUMABLE
from .process._protocol import ProcessContext as _ProcessContext
from .process._signals import install_signal_handlers

_quick_exit.register()  # first of unbroken's atexit handlers: it runs after the others

if _ProcessContext.read().supervised:
    # Launched by `unbroken run`: a stop signal from here on (imports, data building, resume)
    # is a resumable exit 75, not a death by signal (docs/resume.md, "Signals").
    install_signal_handlers()
    _quick_exit.arm_on_uncaught()  # a crash's exit is on the path of the relaunch too
    _stops.record_uncaught()  # what failed, for the supervisor: the same failure again is a bug

if TYPE_CHECKING:
    from ._launch import init_distributed
    from .data import IterableLoader, MapLoader, protect_workers, seed_everything
    from .state import EMA, Stateful
    from .store import CheckpointReader
    from .train import (
        Run,
        RunConfig,
        StepContext,
        export_weights,
        make_deterministic,
        read_metrics,
    )
    from .verify import verify_resume

_LAZY = {
    "CheckpointReader": ".store",
    "EMA": ".state",
    "IterableLoader": ".data",
    "MapLoader": ".data",
    "Run": ".train",
    "RunConfig": ".train",
    "Stateful": ".state",
    "StepContext": ".train",
    "export_weights": ".train",
    "init_distributed": "._launch",
    "make_deterministic": ".train",
    "protect_workers": ".data",
    "read_metrics": ".train",
    "seed_everything": ".data",
    "verify_resume": ".verify",
}

# Names of the first releases that now live in their package (or were renamed): they keep
# working for one release, with a DeprecationWarning naming the new place.
_DEPRECATED = {
    **{
        name: f"unbroken.train.{name}"
        for name in (
            "Change",
            "Constant",
            "EpochTable",
            "LinearWarmup",
            "Piecewise",
            "Settings",
            "StepTable",
            "WarmupCosine",
            "determinism_problems",
            "write_trace",
        )
    },
    **{
        name: f"unbroken.data.{name}"
        for name in (
            "CharVocab",
            "IterableShards",
            "JsonlShards",
            "SamplerLoader",
            "TextCorpus",
            "TokenBatchLoader",
            "WordVocab",
        )
    },
    **{
        name: f"unbroken.errors.{name}"
        for name in (
            "CheckpointNotFoundError",
            "CheckpointWriteError",
            "CollectiveTimeoutError",
            "ConfigTypeError",
            "RemoteStoreError",
            "UnsafeCheckpointError",
        )
    },
    **{
        name: f"unbroken.integrations.{name}"
        for name in (
            "tensorboard_purge_step",
            "tensorboard_writer",
            "wandb_init_args",
            "wandb_run_id",
        )
    },
    **{name: f"unbroken.verify.{name}" for name in ("VerifyError", "VerifyReport", "compare_runs")},
    "CanonicalShards": "unbroken.train.CanonicalGradients",
    "CheckpointStore": "unbroken.store.CheckpointStore",
    "DataLoader": "unbroken.MapLoader",
}

# The public packages: ``unbroken.train.Settings`` works after a plain ``import unbroken``.
_PACKAGES = ("cli", "data", "errors", "integrations", "state", "store", "train", "verify")

__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, _DEPRECATED, _PACKAGES)


__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "ConfigError",
    "CorruptCheckpointError",
    "DataError",
    "EMA",
    "EXIT_RESUMABLE",
    "IterableLoader",
    "LockError",
    "MapLoader",
    "ResumeWarning",
    "Run",
    "RunConfig",
    "StateError",
    "Stateful",
    "StepContext",
    "UnbrokenError",
    "__version__",
    "export_weights",
    "init_distributed",
    "install_signal_handlers",
    "make_deterministic",
    "protect_workers",
    "read_metrics",
    "seed_everything",
    "verify_resume",
]
