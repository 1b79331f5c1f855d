"""Swapping the model mid-run: rebuild the optimizer by parameter name, carry state over, grow.

For every parameter of the new model:

* same name, same shape  -> its optimizer state (and EMA weight) carries over unchanged;
* same name, grown       -> (every dimension >= before) the old state is copied into the leading
  slice of a new tensor; the rest is zero for optimizer moments and the live weight for the EMA
  (a ``grow`` hook may decide otherwise);
* a new name             -> no optimizer state yet (created at its first step); EMA = live weight;
* same name, shrunk or another rank -> an error naming it, unless the ``grow`` hook handles it.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, StateError
from ..state import EMA, Counters, Registry
from ..state._adapters import unwrap
from ._audit import retire
from ._reduction import fix_layouts

GrowHook = Callable[[str, str, torch.Tensor, torch.Size], torch.Tensor | None]
"""``grow(name, what, old, new_shape)``: what is "param_state:<key>" or "ema"; return the new
tensor, or None for the default (old values in the leading slice, zeros / live weights)."""


@dataclass
class Change:
    """What a callback may return: a new model, config overrides, a new stage."""

    model: torch.nn.Module | None = None
    config: dict[str, Any] = field(default_factory=dict)
    stage: Any = None


@dataclass
class Remap:
    unchanged: list[str] = field(default_factory=list)
    grown: list[str] = field(default_factory=list)
    remapped: list[str] = field(default_factory=list)  # not growth: left to the grow hook
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "grown": self.grown,
            "remapped": self.remapped,
            "added": self.added,
            "removed": self.removed,
            "unchanged": len(self.unchanged),
        }


def classify(
    old: dict[str, torch.Size], new: dict[str, torch.Size], grow: GrowHook | None
) -> Remap:
    r = Remap()
    for name, shape in new.items():
        before = old.get(name)
        if before is None:
            r.added.append(name)
        elif before == shape:
            r.unchanged.append(name)
        elif _is_growth(before, shape):
            r.grown.append(name)
        elif grow is not None:
            r.remapped.append(name)
        else:
            raise ConfigError(
                f"parameter {name!r} changed shape from {list(before)} to {list(shape)}, which "
                "is not growth (every dimension >= before); pass grow= to Run to remap it"
            )
    r.removed = [n for n in old if n not in new]
    return r


def _is_growth(before: torch.Size, after: torch.Size) -> bool:
    return len(before) == len(after) and all(b <= a for b, a in zip(before, after, strict=True))


def _remap(
    grow: GrowHook | None, name: str, what: str, old: torch.Tensor, shape: torch.Size
) -> torch.Tensor | None:
    """The grow hook's tensor for ``name`` (checked), or None where the default applies."""
    custom = grow(name, what, old, shape) if grow is not None else None
    if custom is None:
        if not _is_growth(old.shape, shape):
            raise ConfigError(
                f"grow= returned None for {what} of {name!r}, but {list(old.shape)} -> "
                f"{list(shape)} is not growth; return a tensor of shape {list(shape)}"
            )
        return None
    if not isinstance(custom, torch.Tensor) or custom.shape != shape or custom.dtype != old.dtype:
        got = (
            f"{list(custom.shape)} {custom.dtype}"
            if isinstance(custom, torch.Tensor)
            else type(custom).__name__
        )
        raise ConfigError(
            f"grow= returned {got} for {what} of {name!r}; expected shape {list(shape)} {old.dtype}"
        )
    return custom


def grown(old: torch.Tensor, new_shape: torch.Size, fill: torch.Tensor | None) -> torch.Tensor:
    """A tensor of ``new_shape``: ``old`` in the leading slice, ``fill`` (or zeros) elsewhere."""
    out = fill.detach().clone() if fill is not None else old.new_zeros(new_shape)
    if out.shape != new_shape:
        raise StateError(f"fill has shape {list(out.shape)}, expected {list(new_shape)}")
    out[tuple(slice(0, s) for s in old.shape)] = old
    return out


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".#.", name)


def rebuild_optimizer(
    old: torch.optim.Optimizer,
    old_model: torch.nn.Module,
    new_model: torch.nn.Module,
    factory: Callable[[torch.nn.Module], torch.optim.Optimizer] | None,
) -> torch.optim.Optimizer:
    """A fresh optimizer for ``new_model``: the factory's, or the old one's class and groups.

    Without a factory each parameter joins the group its name had before; a new name joins the
    group of a parameter with the same name up to layer numbers (``blocks.3.ln.weight`` joins
    ``blocks.1.ln.weight``'s), else group 0.
    """
    if factory is not None:
        return factory(new_model)
    by_id = {id(p): n for n, p in old_model.named_parameters()}
    group_of: dict[str, int] = {}
    for gi, g in enumerate(old.param_groups):
        for p in g["params"]:
            if id(p) in by_id:
                group_of[by_id[id(p)]] = gi
    pattern_group = {_pattern(n): gi for n, gi in group_of.items()}
    groups: list[dict[str, Any]] = [
        {k: v for k, v in g.items() if k != "params"} | {"params": []} for g in old.param_groups
    ]
    for name, p in new_model.named_parameters():
        if not p.requires_grad:
            continue
        gi = group_of.get(name, pattern_group.get(_pattern(name), 0))
        groups[gi]["params"].append(p)
    groups = [g for g in groups if g["params"]]
    # Each group carries every hyperparameter; pass the defaults the constructor accepts, then
    # copy them all (some, like AdamW's decoupled_weight_decay, are not constructor arguments).
    accepted = inspect.signature(type(old).__init__).parameters
    new = type(old)(groups, **{k: v for k, v in old.defaults.items() if k in accepted})
    new.defaults = dict(old.defaults)
    return new


def carry_optimizer_state(
    old: torch.optim.Optimizer,
    old_model: torch.nn.Module,
    new: torch.optim.Optimizer,
    new_model: torch.nn.Module,
    grow: GrowHook | None,
) -> None:
    old_params = dict(old_model.named_parameters())
    for name, p in new_model.named_parameters():
        q = old_params.get(name)
        if q is None or q not in old.state:
            continue
        state: dict[str, Any] = {}
        for key, v in old.state[q].items():
            if isinstance(v, torch.Tensor) and v.shape == q.shape and q.shape != p.shape:
                custom = _remap(grow, name, f"param_state:{key}", v, p.shape)
                state[key] = custom if custom is not None else grown(v, p.shape, None)
            else:
                state[key] = v
        new.state[p] = state


def grow_ema(ema: EMA, new_model: torch.nn.Module, grow: GrowHook | None) -> None:
    live = new_model.state_dict()
    shadow: dict[str, torch.Tensor] = {}
    for name, v in live.items():
        old = ema.shadow.get(name)
        if old is None:
            shadow[name] = v.detach().clone()
        elif old.shape == v.shape:
            shadow[name] = old
        else:
            custom = _remap(grow, name, "ema", old, v.shape)
            shadow[name] = custom if custom is not None else grown(old, v.shape, v.detach())
    ema.model = new_model
    ema.shadow = shadow


def shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    return {n: p.shape for n, p in model.named_parameters()}


def as_change(value: Any, where: str, known: set[str]) -> Change | None:
    """Validate a callback's return value."""
    if value is None:
        return None
    if isinstance(value, torch.nn.Module):
        return Change(model=value)
    if isinstance(value, dict):
        value = Change(config=dict(value))
    if not isinstance(value, Change):
        raise ConfigError(
            f"{where} returned {type(value).__qualname__}; return None, a model, a dict of "
            "settings, or unbroken.train.Change(model=..., config=..., stage=...)"
        )
    unknown = sorted(set(value.config) - known)
    if unknown:
        raise ConfigError(
            f"{where} returned unknown setting(s) {unknown}; known settings: {sorted(known)}"
        )
    if value.model is not None and not isinstance(value.model, torch.nn.Module):
        raise ConfigError(f"{where} returned model={type(value.model).__qualname__}, not a Module")
    return value


class ModelSwap:
    """Replaces the tracked model (a callback's new model, or a resume into another stage):
    the optimizer is rebuilt by parameter name with its state carried over and grown, LR
    schedulers are pointed at it, the EMA grows, the new model is wrapped like the old one, and
    the replaced optimizer and model refuse to train from then on."""

    def __init__(
        self,
        registry: Registry,
        counters: Counters,
        *,
        grow: GrowHook | None,
        optimizer_factory: Callable[[Any], Any] | None,
        wrap_model: Callable[[torch.nn.Module], torch.nn.Module] | None,
        on_changed: Callable[[dict[str, Any]], None],
    ) -> None:
        self.registry, self.counters = registry, counters
        self.grow, self.optimizer_factory, self.wrap_model = grow, optimizer_factory, wrap_model
        self.on_changed = on_changed

    def __call__(self, new: torch.nn.Module, reason: str) -> Remap:
        reg = self.registry
        model_name, tracked = reg.first("model", torch.nn.Module)
        if model_name is None or tracked is None:
            raise ConfigError("a model change needs a tracked nn.Module component")
        old = unwrap(tracked)
        new = unwrap(new)
        remap = classify(shapes(old), shapes(new), self.grow)
        opt_name, old_opt = reg.first("optimizer", torch.optim.Optimizer)
        if old_opt is not None and opt_name is not None:
            new_opt = rebuild_optimizer(old_opt, old, new, self.optimizer_factory)
            carry_optimizer_state(old_opt, old, new_opt, new, self.grow)
            self._repoint_schedulers(old_opt, new_opt)
            reg.replace(opt_name, new_opt)
        # The script's own variables still point at the old ones: never train them silently.
        retire(old_opt, old, new, self.counters.step)
        _, ema = reg.first("ema", EMA)
        if ema is not None and unwrap(ema.model) is old:
            grow_ema(ema, new, self.grow)
        wrapped = _rewrap(tracked, new, self.wrap_model)
        fix_layouts([wrapped])  # a new DDP reduces in one layout too
        reg.replace(model_name, wrapped)
        self.on_changed({"reason": reason, **remap.summary()})
        return remap

    def _repoint_schedulers(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        for comp in self.registry:
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
