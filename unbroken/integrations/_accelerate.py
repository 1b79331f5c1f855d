"""Hugging Face Accelerate: an :class:`unbroken.Run` over what ``accelerator.prepare`` returned.

Accelerate already keeps the list of what a checkpoint must hold: the models, optimizers and
schedulers it prepared, its GradScaler and the objects given to ``register_for_checkpointing``
(``accelerator.save_state`` writes exactly these). :func:`accelerate_run` tracks the same
objects, unwrapped to the plain torch ones, plus the accumulation counter that decides which
micro-batch steps the optimizer, plus what you pass (the ``unbroken.MapLoader``)::

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    run = accelerate_run(accelerator, "runs/x", loader=loader, save_every=100, max_steps=1000)
    for batch in run.loop(loader):
        with accelerator.accumulate(model):
            ...
        if accelerator.sync_gradients:
            run.step(loss=loss)

A DataLoader that ``prepare`` wrapped (a ``DataLoaderShard``) keeps no resumable position and
is refused; ``unbroken.MapLoader`` passes through ``prepare`` unchanged and is the position.
"""

from __future__ import annotations

import gc
from typing import Any

from ..errors import ConfigError
from ..process import _log
from ..train._reduction import fix_layouts

log = _log.get()

# Tested: one process, or DDP. Sharding engines keep their own optimizer state layout.
_UNTESTED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA", "TP")


class _AccumulationCounter:
    """``accelerator.step``: micro-batches into the current accumulation cycle (decides when
    ``accelerator.sync_gradients`` is True, i.e. when the optimizer really steps)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.accelerator.step = int(state_dict["step"])


def _prepared_models(accelerator: Any) -> list[Any]:
    """The models as ``prepare`` returned them. ``accelerator._models`` holds them wrapped in
    ``DistributedDataParallel`` on GPUs, but on CPU (``MULTI_CPU``, accelerate 1.x) the module
    before DDP wrapped it, the DDP only in what ``prepare`` returned: that DDP is found by the
    module it wraps (``ddp.module``)."""
    from torch.nn.parallel import DistributedDataParallel

    models = list(accelerator._models)
    bare = {id(m) for m in models if not isinstance(m, DistributedDataParallel)}
    if bare and int(getattr(accelerator, "num_processes", 1)) > 1:
        models += [
            obj
            for obj in gc.get_objects()
            if issubclass(type(obj), DistributedDataParallel) and id(obj.module) in bare
        ]
    return models


def accelerate_run(accelerator: Any, run_dir: str, /, *, strict: bool = True, **kwargs: Any) -> Any:
    """An :class:`unbroken.Run` tracking everything ``accelerator`` prepared or registered.

    Call it after ``accelerator.prepare(...)``. ``kwargs`` are more components (the
    ``unbroken.MapLoader``, an ``unbroken.EMA``, ...) and ``Run`` options (``save_every``,
    ``max_steps``, ...). With ``strict=False`` what cannot be resumed exactly (a DataLoader that
    ``prepare`` wrapped, an untested sharding engine) is a warning instead of an error.
    """
    from ..train import Run, RunConfig

    def inexact(message: str) -> None:
        if strict:
            raise ConfigError(f"accelerate_run: {message} (or pass strict=False)")
        log.warning("unbroken: resume will not be exact: %s", message)

    if not hasattr(accelerator, "gradient_state") or not hasattr(accelerator, "_models"):
        raise ConfigError(
            f"accelerate_run needs an accelerate.Accelerator, got {type(accelerator).__qualname__}"
        )
    for dl in accelerator._dataloaders:
        inexact(
            f"accelerator.prepare() wrapped a {type(dl).__qualname__}, whose mid-epoch position "
            "accelerate replays by skipping batches; pass unbroken.MapLoader(dataset, "
            "batch_size, seed=...) instead (prepare leaves it as it is) and give it here as "
            "loader=..."
        )
    kind = str(getattr(accelerator.distributed_type, "name", accelerator.distributed_type))
    if kind in _UNTESTED:
        inexact(f"distributed type {kind} is not supported by unbroken's accelerate adapter")

    comps: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        comps["model" if i == 0 else f"model.{i}"] = accelerator.unwrap_model(model)
    for i, opt in enumerate(accelerator._optimizers):
        comps["optimizer" if i == 0 else f"optimizer.{i}"] = getattr(opt, "optimizer", opt)
    for i, sched in enumerate(accelerator._schedulers):
        comps["scheduler" if i == 0 else f"scheduler.{i}"] = getattr(sched, "scheduler", sched)
    if accelerator.scaler is not None:
        comps["scaler"] = accelerator.scaler
    for i, obj in enumerate(accelerator._custom_objects):
        comps[f"custom.{i}"] = obj
    comps["accumulation"] = _AccumulationCounter(accelerator)
    options = {k: v for k, v in kwargs.items() if k in RunConfig.fields()}
    extra = {k: v for k, v in kwargs.items() if k not in options}
    clash = sorted(set(comps) & set(extra))
    if clash:
        raise ConfigError(
            f"accelerate_run: {clash} are tracked from the accelerator already; "
            "pass only what prepare() did not see (the unbroken.MapLoader, an EMA, ...)"
        )
    if not any(getattr(v, "kind", None) == "loader" for v in extra.values()):
        inexact(
            "no unbroken.MapLoader was given (loader=...); the data position would not be saved"
        )
    # DDP as prepared: one reduction layout (train/_reduction).
    fix_layouts(_prepared_models(accelerator))
    return Run(run_dir, **comps, **extra, **options)
