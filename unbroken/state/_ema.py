"""Exponential moving average of a model's weights, saved and restored exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import ConfigError, StateError

EMA_VERSION = 1


BEFORE_UPDATE: list[Callable[[], None]] = []
"""Called before every :meth:`EMA.update` changes a shadow tensor in place."""


class EMA:
    """Smoothed copies of a model's floating-point parameters and buffers.

    ``shadow = decay * shadow + (1 - decay) * live`` after each :meth:`update`; integer buffers
    (e.g. BatchNorm's ``num_batches_tracked``) are copied. Track it like any component::

        ema = unbroken.EMA(model, decay=0.999)
        run = unbroken.Run("runs/x", model=model, optimizer=opt, ema=ema)
        ...
        opt.step(); ema.update()
        with ema.applied():        # evaluate with the smoothed weights
            evaluate(model)

    ``decay`` may be a callable of the number of updates done so far (a warmup, say).
    """

    def __init__(self, model: torch.nn.Module, decay: float | Callable[[int], float] = 0.999):
        if not callable(decay) and not 0.0 <= float(decay) <= 1.0:
            raise ConfigError(f"EMA decay must be in [0, 1], got {decay!r}")
        self.model = model
        self.decay = decay
        self.updates = 0
        self.shadow: dict[str, torch.Tensor] = {
            k: v.detach().clone() for k, v in model.state_dict().items()
        }

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[Any, Any]]]:
        live = self.model.state_dict()
        if live.keys() != self.shadow.keys():
            missing = sorted(self.shadow.keys() - live.keys())[:3]
            new = sorted(live.keys() - self.shadow.keys())[:3]
            raise StateError(
                f"EMA: the model's state keys changed since the EMA was made (gone: {missing}, "
                f"new: {new}); change the model through Run -- a before_step or on_epoch_start "
                "callback returning unbroken.train.Change(model=...) -- which grows the EMA with "
                "it, or make a new unbroken.EMA(model)"
            )
        avg_s, avg_l, copy = [], [], []
        for k, s in self.shadow.items():
            v = live[k]
            if s.is_floating_point():
                avg_s.append(s)
                avg_l.append(v.detach())
            else:
                copy.append((s, v))
        return avg_s, avg_l, copy

    def current_decay(self) -> float:
        return float(self.decay(self.updates)) if callable(self.decay) else float(self.decay)

    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current weights into the average; call after each optimizer step."""
        for hook in BEFORE_UPDATE:
            hook()  # an in-memory snapshot may be copying the shadow (train/_snapshots.py)
        d = self.current_decay()
        avg_s, avg_l, copy = self._pairs()
        if avg_s:
            torch._foreach_lerp_(avg_s, avg_l, 1.0 - d)
        for s, v in copy:
            s.copy_(v)
        self.updates += 1

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module | None = None) -> None:
        """Write the smoothed weights into ``model`` (default: the tracked one)."""
        (model or self.model).load_state_dict(self.shadow)

    @contextmanager
    def applied(self) -> Iterator[torch.nn.Module]:
        """Temporarily put the smoothed weights into the model, e.g. for evaluation."""
        backup = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.copy_to()
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.model.load_state_dict(backup)

    def state_dict(self) -> dict[str, Any]:
        return {"version": EMA_VERSION, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != EMA_VERSION:
            raise StateError(f"EMA state has version {state_dict.get('version')!r}")
        shadow = state_dict["shadow"]
        if shadow.keys() != self.shadow.keys():
            raise StateError(
                f"EMA keys differ from the checkpoint: missing "
                f"{sorted(self.shadow.keys() - shadow.keys())}, unexpected "
                f"{sorted(shadow.keys() - self.shadow.keys())}"
            )
        with torch.no_grad():
            for k, v in shadow.items():
                if v is not self.shadow[k]:
                    self.shadow[k].copy_(v)
        self.updates = int(state_dict["updates"])
