"""unbroken: stop a PyTorch training run anywhere; relaunch; it continues bit for bit.

The public names are imported lazily, so that ``import unbroken`` (and the ``unbroken``
command, e.g. the supervisor) does not pay for importing torch until it is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _lazy
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CollectiveTimeoutError,
    ConfigError,
    ConfigTypeError,
    CorruptCheckpointError,
    DataError,
    LockError,
    RemoteStoreError,
    ResumeWarning,
    StateError,
    UnbrokenError,
    UnsafeCheckpointError,
)
from ._version import __version__
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
    from .data import (
        CharVocab,
        DataLoader,
        IterableLoader,
        IterableShards,
        JsonlShards,
        SamplerLoader,
        TextCorpus,
        TokenBatchLoader,
        WordVocab,
        protect_workers,
        seed_everything,
    )
    from .integrations._trackers import (
        tensorboard_purge_step,
        tensorboard_writer,
        wandb_init_args,
        wandb_run_id,
    )
    from .state import EMA, Stateful
    from .store import CheckpointReader, CheckpointStore
    from .train import (
        Change,
        Constant,
        EpochTable,
        LinearWarmup,
        Piecewise,
        Run,
        RunConfig,
        Settings,
        StepContext,
        StepTable,
        WarmupCosine,
        export_weights,
        read_metrics,
        write_trace,
    )
    from .train._canonical import CanonicalShards
    from .train._determinism import determinism_problems, make_deterministic
    from .verify import VerifyError, VerifyReport, compare_runs, verify_resume

_LAZY = {
    "CanonicalShards": ".train._canonical",
    "Change": ".train",
    "CharVocab": ".data",
    "CheckpointReader": ".store",
    "CheckpointStore": ".store",
    "Constant": ".train",
    "DataLoader": ".data",
    "EMA": ".state",
    "EpochTable": ".train",
    "IterableLoader": ".data",
    "IterableShards": ".data",
    "JsonlShards": ".data",
    "LinearWarmup": ".train",
    "Piecewise": ".train",
    "Run": ".train",
    "RunConfig": ".train",
    "SamplerLoader": ".data",
    "Settings": ".train",
    "Stateful": ".state",
    "StepContext": ".train",
    "StepTable": ".train",
    "TextCorpus": ".data",
    "TokenBatchLoader": ".data",
    "VerifyError": ".verify",
    "VerifyReport": ".verify",
    "WarmupCosine": ".train",
    "WordVocab": ".data",
    "compare_runs": ".verify",
    "determinism_problems": ".train._determinism",
    "export_weights": ".train",
    "init_distributed": "._launch",
    "make_deterministic": ".train._determinism",
    "protect_workers": ".data",
    "read_metrics": ".train",
    "seed_everything": ".data",
    "tensorboard_purge_step": ".integrations._trackers",
    "tensorboard_writer": ".integrations._trackers",
    "verify_resume": ".verify",
    "wandb_init_args": ".integrations._trackers",
    "wandb_run_id": ".integrations._trackers",
    "write_trace": ".train",
}


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)


__all__ = [
    "CanonicalShards",
    "Change",
    "CharVocab",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointStore",
    "CheckpointWriteError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ConfigTypeError",
    "Constant",
    "CorruptCheckpointError",
    "DataError",
    "DataLoader",
    "EMA",
    "EXIT_RESUMABLE",
    "EpochTable",
    "IterableLoader",
    "IterableShards",
    "JsonlShards",
    "LinearWarmup",
    "LockError",
    "Piecewise",
    "RemoteStoreError",
    "ResumeWarning",
    "Run",
    "RunConfig",
    "SamplerLoader",
    "Settings",
    "StateError",
    "Stateful",
    "StepContext",
    "StepTable",
    "TextCorpus",
    "TokenBatchLoader",
    "UnbrokenError",
    "UnsafeCheckpointError",
    "VerifyError",
    "VerifyReport",
    "WarmupCosine",
    "WordVocab",
    "__version__",
    "compare_runs",
    "determinism_problems",
    "export_weights",
    "init_distributed",
    "install_signal_handlers",
    "make_deterministic",
    "protect_workers",
    "read_metrics",
    "seed_everything",
    "tensorboard_purge_step",
    "tensorboard_writer",
    "verify_resume",
    "wandb_init_args",
    "wandb_run_id",
    "write_trace",
]
