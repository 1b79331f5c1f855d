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
from typing import Any, Protocol

import torch

from ..errors import ConfigError
from ..state import EMA, Counters, Registry
from ..state._adapters import unwrap
from . import _staging, _stopping
from ._audit import Audit
from ._config import RunConfig
from ._settings import KNOWN, Settings, Values


class RunView(Protocol):
    """What a callback reaches through ``ctx.run``: the :class:`unbroken.Run` itself."""

    dir: str
    counters: Counters

    @property
    def model(self) -> Any: ...

    @property
    def optimizer(self) -> Any: ...

    def save(self, *, blocking: bool | None = None) -> str: ...


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
    run: RunView


Callback = Callable[[StepContext], Any]
EndEpoch = Callable[[int, bool], None]
"""``end_epoch(next_epoch, last)``: the run counts an epoch that ended (and may save)."""


class Stepper:
    """Step starts of ``run.loop()``: events, settings, callbacks and model changes.

    Given what it works on (components, counters, options, the audit, the model swap) rather
    than the run; ``view`` is only handed on to callbacks as ``ctx.run``.
    """

    def __init__(
        self,
        registry: Registry,
        counters: Counters,
        config: RunConfig,
        audit: Audit,
        swap: _staging.ModelSwap,
        view: RunView,
    ) -> None:
        self.registry, self.counters, self.config = registry, counters, config
        self.audit, self.swap, self.view = audit, swap, view
        self.settings: Settings = config.settings or Settings()
        self.values: Values = self.settings.at(0, 0)
        self.known = set(KNOWN) | set(self.settings.keys())
        self.accumulating = False
        # The epoch whose on_epoch_start ran last in this process (a resume replays none), and
        # whether a position-less source just began a new pass (see _epoch_begins).
        self._started_epoch: int | None = None
        self._new_pass: bool | None = None

    # ---- components -----------------------------------------------------------------------------

    def model(self) -> torch.nn.Module | None:
        return self.registry.first("model", torch.nn.Module)[1]

    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.registry.first("optimizer", torch.optim.Optimizer)[1]

    def ema(self) -> EMA | None:
        return self.registry.first("ema", EMA)[1]

    # ---- the loop -------------------------------------------------------------------------------

    def loop(
        self,
        loader: Iterable[Any],
        epochs: int | None,
        *,
        end_epoch: EndEpoch,
        halted: Callable[[], bool],
        safe_point: Callable[[str], None],
    ) -> Iterator[Any]:
        """Micro-batches of ``loader`` across epochs; ``halted()`` says when the run is done
        or stopped, ``end_epoch`` counts each epoch that ends, ``safe_point(where)`` honours a
        recorded stop at each step start."""
        self.audit.loop_started(loader, check_source=True)
        it: Iterator[Any] | None = None
        left = step_batches = 0
        empty_passes = 0
        # Batches drawn in the epoch and the step count at its start: a whole epoch must hold
        # an optimizer step (one resumed mid-way may end inside a step's micro-batches).
        drawn, step_before = 0, self.counters.step
        whole = getattr(loader, "position", 0) == 0
        while True:
            if left == 0:
                if halted():
                    break
                safe_point("a step start")
                if _finished(loader):
                    it = None
                    self._check_epoch(drawn * whole, step_before)
                    drawn, step_before, whole = 0, self.counters.step, True
                    nxt = self._advance(loader)
                    end_epoch(nxt, _reached(epochs, nxt))
                if epochs is not None and self.counters.epoch >= epochs:
                    break
                left = step_batches = self.begin_step(loader)
            if it is None:
                if self.config.on_epoch_start is not None and self._epoch_begins(loader):
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
                self._check_epoch(drawn * whole, step_before)
                drawn, step_before, whole = 0, self.counters.step, True
                nxt = self._advance(loader)
                end_epoch(nxt, _reached(epochs, nxt))
                if epochs is not None and self.counters.epoch >= epochs:
                    break
                continue
            empty = False
            drawn += 1
            self.counters.epoch = getattr(loader, "epoch", self.counters.epoch)
            left -= 1
            self.accumulating = left > 0
            yield batch
        self.accumulating = False

    def _check_epoch(self, drawn: int, step_before: int) -> None:
        _stopping.check_epoch(self.counters.epoch, drawn, step_before, self.counters.step)

    def begin_step(self, loader: Any) -> int:
        """Events and settings of the step that starts now; returns its micro-batch count."""
        c, cfg = self.counters, self.config
        epoch = getattr(loader, "epoch", c.epoch) if loader is not None else c.epoch
        self.audit.step_started()
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
        c = self.counters
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
        c = self.counters
        epoch = getattr(loader, "epoch", c.epoch) if loader is not None else c.epoch
        self._started_epoch, self._new_pass = epoch, False
        result = self.config.on_epoch_start(self._context(epoch))  # type: ignore[misc]
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
        return _advance(self.counters, loader)

    def _context(self, epoch: int) -> StepContext:
        c = self.counters
        values = self.settings.at(c.step, epoch, c.overrides)
        model = self.model()
        inner = unwrap(model) if model is not None else None
        return StepContext(c.step, epoch, inner, self.optimizer(), values, c.stage, self.view)

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
        c = self.counters
        if change.config:
            c.overrides = {**c.overrides, **change.config}
        if change.model is not None:
            if change.stage is None:
                raise ConfigError(
                    f"{where} returned a new model without a stage; return "
                    "unbroken.train.Change(model=..., stage=...) so that a resumed run can rebuild "
                    "this model with model_factory(stage)"
                )
            if self.config.model_factory is None:
                raise ConfigError(
                    f"{where} returned a new model but Run has no model_factory; pass "
                    "model_factory=build(stage) so that a resume can rebuild it"
                )
            self.swap(change.model, where)
        if change.stage is not None:
            c.stage = change.stage


def _finished(loader: Any) -> bool:
    check = getattr(loader, "epoch_finished", None)
    return bool(check()) if callable(check) else False


def _advance(counters: Counters, loader: Any) -> int:
    """Move ``loader`` to its next epoch (its iterator ended); returns that epoch."""
    nxt = getattr(loader, "epoch", counters.epoch) + 1
    if callable(getattr(loader, "set_epoch", None)):
        loader.set_epoch(nxt)
    return int(nxt)


def _reached(epochs: int | None, epoch: int) -> bool:
    return epochs is not None and epoch >= epochs
