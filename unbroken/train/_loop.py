"""The step-driven loop: step starts, settings, callbacks, and model changes.

``run.loop(loader)`` yields micro-batches; at the start of every optimizer step it

1. ends the epoch if the loader's epoch is exhausted (counts it; maybe saves),
2. calls ``on_epoch_start(ctx)`` if this step is the first of its epoch,
3. calls ``before_step(ctx)``,
4. evaluates the settings at (step, epoch) -- schedules, then callback overrides -- and applies
   them: ``lr``/``weight_decay`` to the optimizer, ``batch_size`` to the loader,
5. yields ``grad_accum`` micro-batches (``run.accumulating`` is True for all but the last).

A resume replays no event: what callbacks changed is restored from the checkpoint (the model via
``model_factory(stage)``, overrides and every component), so each event fires exactly as often as
in an uninterrupted run, and the first step after a mid-epoch resume gets ``before_step`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._errors import ConfigError, StateError
from ..state import EMA
from ..state._adapters import unwrap
from . import _audit, _staging, _stopping
from ._settings import KNOWN, Settings, Values

if TYPE_CHECKING:
    from ._run import Run


@dataclass
class StepContext:
    """What callbacks receive."""

    step: int
    """Optimizer steps completed before the step that is starting."""
    epoch: int
    model: torch.nn.Module | None
    """The model, unwrapped from DDP (``run.model`` is the wrapped one, for training)."""
    optimizer: torch.optim.Optimizer | None
    settings: Values
    stage: Any
    run: Run


Callback = Callable[[StepContext], Any]


class Stepper:
    def __init__(self, run: Run) -> None:
        self.run = run
        cfg = run.config
        self.settings: Settings = cfg.settings or Settings()
        self.values: Values = self.settings.at(0, 0)
        self.known = set(KNOWN) | set(self.settings.keys())
        self.accumulating = False
        # The epoch whose on_epoch_start ran last in this process (a resume replays none), and
        # whether a position-less source just began a new pass (see _epoch_begins).
        self._started_epoch: int | None = None
        self._new_pass: bool | None = None

    # ---- components -----------------------------------------------------------------------------

    def _first(self, name: str, kind: type) -> tuple[str, Any] | tuple[None, None]:
        reg = self.run.registry
        if name in reg and isinstance(reg.get(name), kind):
            return name, reg.get(name)
        for c in reg:
            if isinstance(c.obj, kind):
                return c.name, c.obj
        return None, None

    def model(self) -> torch.nn.Module | None:
        return self._first("model", torch.nn.Module)[1]

    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._first("optimizer", torch.optim.Optimizer)[1]

    def ema(self) -> EMA | None:
        return self._first("ema", EMA)[1]

    # ---- the loop -------------------------------------------------------------------------------

    def loop(self, loader: Iterable[Any], epochs: int | None) -> Iterator[Any]:
        run = self.run
        run._audit.loop_started(loader, check_source=True)
        it: Iterator[Any] | None = None
        left = step_batches = 0
        empty_passes = 0
        # Batches drawn in the epoch and the step count at its start: a whole epoch must hold
        # an optimizer step (one resumed mid-way may end inside a step's micro-batches).
        drawn, step_before = 0, run.counters.step
        whole = getattr(loader, "position", 0) == 0
        while True:
            if left == 0:
                if run.done or run.stopped:
                    break
                _stopping.honour(run, "a step start")
                if _finished(loader):
                    it = None
                    _stopping.check_epoch(run, run.counters.epoch, drawn * whole, step_before)
                    drawn, step_before, whole = 0, run.counters.step, True
                    nxt = self._advance(loader)
                    run._end_epoch(nxt, last=_reached(epochs, nxt))
                if epochs is not None and run.counters.epoch >= epochs:
                    break
                left = step_batches = self.begin_step(loader)
            if it is None:
                if run.config.on_epoch_start is not None and self._epoch_begins(loader):
                    # The step's micro-batches reach into a new epoch (grad_accum > 1): the
                    # step that consumes its first sample is this one (issue 17).
                    self._epoch_start(loader, mid_step=left < step_batches)
                it = iter(loader)
                empty = True
            try:
                batch = next(it)
            except StopIteration:
                it = None
                # A pass resumed at the very end of an epoch may yield nothing (what is left of
                # it is too little to give every rank a sample); a second empty pass in a row
                # began at an epoch's start.
                empty_passes = empty_passes + 1 if empty else 0
                if empty_passes > 1:
                    raise ConfigError("the loader yielded no batch for a whole epoch") from None
                _stopping.check_epoch(run, run.counters.epoch, drawn * whole, step_before)
                drawn, step_before, whole = 0, run.counters.step, True
                nxt = self._advance(loader)
                run._end_epoch(nxt, last=_reached(epochs, nxt))
                if epochs is not None and run.counters.epoch >= epochs:
                    break
                continue
            empty = False
            drawn += 1
            run.counters.epoch = getattr(loader, "epoch", run.counters.epoch)
            left -= 1
            self.accumulating = left > 0
            yield batch
        self.accumulating = False

    def begin_step(self, loader: Any) -> int:
        """Events and settings of the step that starts now; returns its micro-batch count."""
        run, c = self.run, self.run.counters
        epoch = getattr(loader, "epoch", c.epoch) if loader is not None else c.epoch
        cfg = run.config
        run._audit.step_started()
        if cfg.on_epoch_start is not None and self._epoch_begins(loader):
            self._epoch_start(loader, mid_step=False)
        if cfg.before_step is not None:
            self._apply(cfg.before_step(self._context(epoch)), "before_step")
        self.values = self.settings.at(c.step, epoch, c.overrides)
        self._apply_values(loader)
        accum = self.values.get("grad_accum", 1)
        if not isinstance(accum, int) or accum < 1:
            raise ConfigError(f"setting grad_accum must be a positive int, got {accum!r}")
        return accum

    def _epoch_begins(self, loader: Any) -> bool:
        """The next batch is the first of its epoch, whose on_epoch_start has not run."""
        c = self.run.counters
        epoch = getattr(loader, "epoch", c.epoch) if loader is not None else c.epoch
        if epoch == self._started_epoch:
            return False
        position = getattr(loader, "position", None) if loader is not None else None
        if position is not None:
            return bool(position == 0)
        # No position (range(n), a generator): a fresh run's first pass, or one that follows
        # an epoch's end in this process.
        return c.step == 0 if self._new_pass is None else self._new_pass

    def _epoch_start(self, loader: Any, *, mid_step: bool) -> None:
        c = self.run.counters
        epoch = getattr(loader, "epoch", c.epoch) if loader is not None else c.epoch
        self._started_epoch, self._new_pass = epoch, False
        result = self.run.config.on_epoch_start(self._context(epoch))  # type: ignore[misc]
        if mid_step:
            change = _staging.as_change(result, "on_epoch_start", self.known)
            if change is not None and change.model is not None:
                raise ConfigError(
                    f"on_epoch_start returned a new model for epoch {epoch}, whose first sample "
                    "falls inside an optimizer step (its grad_accum micro-batches span the "
                    "epoch boundary), where gradients of the old model are pending; change "
                    "the model in before_step (e.g. when ctx.epoch first reaches the epoch), "
                    "which runs at step starts"
                )
        # Settings overrides returned mid-step take effect at the next step start.
        self._apply(result, "on_epoch_start")

    def _advance(self, loader: Any) -> int:
        self._new_pass = True
        return _advance(self.run, loader)

    def _context(self, epoch: int) -> StepContext:
        c = self.run.counters
        values = self.settings.at(c.step, epoch, c.overrides)
        model = self.model()
        inner = unwrap(model) if model is not None else None
        return StepContext(c.step, epoch, inner, self.optimizer(), values, c.stage, self.run)

    def _apply_values(self, loader: Any) -> None:
        v = self.values
        opt = self.optimizer()
        if opt is not None:
            for group in opt.param_groups:
                if "lr" in v:
                    group["lr"] = v["lr"] * group.get("lr_scale", 1.0)
                if "weight_decay" in v:
                    group["weight_decay"] = v["weight_decay"] * group.get("wd_scale", 1.0)
        if "batch_size" in v and loader is not None and hasattr(loader, "batch_size"):
            loader.batch_size = v["batch_size"]

    # ---- callback results -----------------------------------------------------------------------

    def _apply(self, result: Any, where: str) -> None:
        change = _staging.as_change(result, where, self.known)
        if change is None:
            return
        c = self.run.counters
        if change.config:
            c.overrides = {**c.overrides, **change.config}
        if change.model is not None:
            if change.stage is None:
                raise ConfigError(
                    f"{where} returned a new model without a stage; return "
                    "unbroken.Change(model=..., stage=...) so that a resumed run can rebuild "
                    "this model with model_factory(stage)"
                )
            if self.run.config.model_factory is None:
                raise ConfigError(
                    f"{where} returned a new model but Run has no model_factory; pass "
                    "model_factory=build(stage) so that a resume can rebuild it"
                )
            self.swap_model(change.model, reason=where)
        if change.stage is not None:
            c.stage = change.stage

    def swap_model(self, new: torch.nn.Module, *, reason: str) -> _staging.Remap:
        """Replace the model; rebuild the optimizer by name, carry and grow state and the EMA."""
        run, cfg = self.run, self.run.config
        model_name, tracked = self._first("model", torch.nn.Module)
        if model_name is None or tracked is None:
            raise ConfigError("a model change needs a tracked nn.Module component")
        old = unwrap(tracked)
        new = unwrap(new)
        remap = _staging.classify(_staging.shapes(old), _staging.shapes(new), cfg.grow)
        opt_name, old_opt = self._first("optimizer", torch.optim.Optimizer)
        if old_opt is not None and opt_name is not None:
            new_opt = _staging.rebuild_optimizer(old_opt, old, new, cfg.optimizer_factory)
            _staging.carry_optimizer_state(old_opt, old, new_opt, new, cfg.grow)
            self._repoint_schedulers(old_opt, new_opt)
            run.registry.replace(opt_name, new_opt)
        # The script's own variables still point at the old ones: never train them silently.
        _audit.retire(old_opt, old, new, run.counters.step)
        ema = self.ema()
        if ema is not None and unwrap(ema.model) is old:
            _staging.grow_ema(ema, new, cfg.grow)
        run.registry.replace(model_name, _rewrap(tracked, new, cfg.wrap_model))
        run._log_event("model_changed", reason=reason, **remap.summary())
        return remap

    def _repoint_schedulers(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        for comp in self.run.registry:
            sched = comp.obj
            if getattr(sched, "optimizer", None) is old:
                if len(old.param_groups) != len(new.param_groups):
                    raise StateError(
                        f"LR scheduler {comp.name!r} drives an optimizer whose param groups "
                        "changed in number; use the lr setting instead of a torch scheduler"
                    )
                sched.optimizer = new


def _rewrap(
    tracked: torch.nn.Module,
    new: torch.nn.Module,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None,
) -> torch.nn.Module:
    """Wrap a new model like the old one was: ``wrap_model`` if given, else DDP like before."""
    if wrap is not None:
        return wrap(new)
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(tracked, DDP):
        return DDP(
            new,
            device_ids=tracked.device_ids,
            output_device=tracked.output_device,
            broadcast_buffers=tracked.broadcast_buffers,
            find_unused_parameters=tracked.find_unused_parameters,
        )
    return new


def _finished(loader: Any) -> bool:
    check = getattr(loader, "epoch_finished", None)
    return bool(check()) if callable(check) else False


def _advance(run: Run, loader: Any) -> int:
    """Move ``loader`` to its next epoch (its iterator ended); returns that epoch."""
    nxt = getattr(loader, "epoch", run.counters.epoch) + 1
    if callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(nxt)
    return int(nxt)


def _reached(epochs: int | None, epoch: int) -> bool:
    return epochs is not None and epoch >= epochs
