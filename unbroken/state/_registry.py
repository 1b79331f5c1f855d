"""The flat registry of named components and the required-state manifest.

``collect`` turns every component into JSON trees plus one flat dict of tensors; ``plan`` and
``restore`` do the reverse against a checkpoint's trees: plan picks, for every saved tensor, the
live tensor to load into (in place) or a fresh one, and checks that what is tracked now and
what was saved agree, naming the first thing that does not.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, StateError
from . import _nested
from ._adapters import (
    GenericState,
    ModuleState,
    NumpyGeneratorState,
    OptimizerState,
    PythonRandomState,
    TorchGeneratorState,
)
from ._stateful import Stateful

_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(slots=True)
class Component:
    """One tracked object of a ``Registry``: its name, the object and its adapter."""

    name: str
    obj: Any
    adapter: Any
    rank_local: bool
    optional: bool = False


@dataclass(slots=True)
class Payload:
    """What one rank contributes to a checkpoint."""

    global_trees: dict[str, Any] = field(default_factory=dict)
    local_trees: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """The shape and dtype of a saved tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def local_prefix(name: str, rank: int) -> str:
    """Rank-local tensors get the rank in their name: DCP de-duplicates equal keys across ranks."""
    return f"{name}@rank{rank}"


class Registry:
    """Named components, in registration order; RNG-like components restore last."""

    def __init__(self) -> None:
        self._items: dict[str, Component] = {}
        self.version = 0  # bumped by add/replace: what callers derived from the items is stale

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self):
        return iter(self._items.values())

    def names(self) -> list[str]:
        return list(self._items)

    def get(self, name: str) -> Any:
        return self._items[name].obj

    def first(self, name: str, kind: type) -> tuple[str, Any] | tuple[None, None]:
        """The component called ``name`` if it is a ``kind``, else the first ``kind`` tracked
        (the run's model, optimizer and EMA are found this way)."""
        if name in self._items and isinstance(self._items[name].obj, kind):
            return name, self._items[name].obj
        for c in self:
            if isinstance(c.obj, kind):
                return c.name, c.obj
        return None, None

    def modules(self) -> dict[str, torch.nn.Module]:
        return {c.name: c.obj for c in self if isinstance(c.obj, torch.nn.Module)}

    def add(
        self,
        name: str,
        obj: Any,
        *,
        rank_local: bool | None = None,
        optional: bool = False,
    ) -> None:
        """Track ``obj`` under ``name``; ``optional`` allows it to be absent from a checkpoint."""
        if not name or not set(name) <= _NAME_OK or name.startswith("."):
            raise ConfigError(
                f"component name {name!r} must be non-empty and use only letters, digits, "
                "'_', '-' and '.'"
            )
        if name in self._items:
            raise ConfigError(f"a component named {name!r} is already tracked")
        adapter, local = self._adapt(obj)
        self._items[name] = Component(
            name, obj, adapter, local if rank_local is None else rank_local, optional
        )
        self.version += 1

    def replace(self, name: str, obj: Any) -> None:
        """Swap the object behind a tracked name (used when a callback returns a new model)."""
        old = self._items[name]
        adapter, _ = self._adapt(obj)
        self._items[name] = Component(name, obj, adapter, old.rank_local, old.optional)
        self.version += 1

    def _adapt(self, obj: Any) -> tuple[Any, bool]:
        if isinstance(obj, torch.nn.Module):
            return ModuleState(obj), False
        if isinstance(obj, torch.optim.Optimizer):
            return OptimizerState(obj, _LiveModules(self)), False
        if isinstance(obj, torch.Generator):
            return TorchGeneratorState(obj), True
        if isinstance(obj, np.random.Generator):
            return NumpyGeneratorState(obj), True
        if isinstance(obj, np.random.RandomState):
            return NumpyRandomStateState(obj), True
        if isinstance(obj, random.Random):
            return PythonRandomState(obj), True
        if isinstance(obj, Stateful):
            return GenericState(obj), bool(getattr(obj, "rank_local", False))
        raise ConfigError(
            f"cannot track an object of type {type(obj).__qualname__}: it needs state_dict() "
            "and load_state_dict() (or be a module, optimizer or random generator)"
        )

    # ---- saving -------------------------------------------------------------------------------

    def collect(self, rank: int = 0) -> Payload:
        """Every component's state as JSON trees and tensors (tensors are live, not copies)."""
        out = Payload()
        for c in self:
            sd = c.adapter.state_dict()
            prefix = local_prefix(c.name, rank) if c.rank_local else c.name
            tree, tensors = _nested.split(sd, prefix)
            (out.local_trees if c.rank_local else out.global_trees)[c.name] = tree
            out.tensors.update(tensors)
            out.kinds[c.name] = str(getattr(c.obj, "kind", None) or getattr(c.adapter, "kind", ""))
        return out

    # ---- loading ------------------------------------------------------------------------------

    def check_names(
        self,
        saved: Iterable[str],
        *,
        allow_missing: Iterable[str] = (),
        allow_unexpected: Iterable[str] = (),
        where: str = "the checkpoint",
    ) -> list[str]:
        """Names to restore; raise StateError on a required-state mismatch."""
        saved_set = set(saved)
        missing_ok = set(allow_missing) | {c.name for c in self if c.optional}
        missing = [n for n in self.names() if n not in saved_set and n not in missing_ok]
        if missing:
            raise StateError(
                f"tracked component(s) {missing} are not in {where}; track the same components "
                f"as when it was saved, or allow starting them fresh with allow_missing={missing!r}"
            )
        unexpected = sorted(saved_set - set(self.names()) - set(allow_unexpected))
        if unexpected:
            raise StateError(
                f"{where} holds component(s) {unexpected} that are not tracked now; track them, "
                f"or ignore them with allow_unexpected={unexpected!r}"
            )
        return [n for n in self.names() if n in saved_set]

    def plan(
        self,
        names: Iterable[str],
        trees: Mapping[str, Any],
        saved: Mapping[str, TensorInfo],
    ) -> dict[str, torch.Tensor]:
        """Target tensors for every saved tensor of ``names``: live ones in place where they fit."""
        targets: dict[str, torch.Tensor] = {}
        for name in names:
            c = self._items[name]
            live_tree, live = _nested.split(c.adapter.state_dict(), "")
            live_by_path = {k: v for k, v in live.items()}
            wanted = _nested.tensor_names(trees[name])
            prefix = wanted[0].split("/", 1)[0] if wanted else name
            templates = getattr(c.adapter, "templates", None)
            make = templates() if templates is not None and wanted else None
            for key in wanted:
                info = saved.get(key)
                if info is None:
                    raise StateError(f"tensor {key!r} of component {name!r} is not in the payload")
                path = key[len(prefix) :]
                cur = live_by_path.get(path)
                if cur is not None and tuple(cur.shape) != info.shape:
                    raise StateError(
                        f"{name}: tensor {path.lstrip('/')!r} has shape {list(cur.shape)} now "
                        f"but {list(info.shape)} in the checkpoint; build the model as it was "
                        "when saved (a model_factory(stage) rebuilds it)"
                    )
                if cur is not None and cur.dtype != info.dtype:
                    raise StateError(
                        f"{name}: tensor {path.lstrip('/')!r} has dtype {cur.dtype} now but "
                        f"{info.dtype} in the checkpoint"
                    )
                if cur is not None and _loadable_in_place(cur):
                    targets[key] = cur
                    continue
                made = make(path, info.shape, info.dtype) if make is not None else None
                targets[key] = (
                    made if made is not None else torch.empty(info.shape, dtype=info.dtype)
                )
        return targets

    def check_untracked_parameters(self) -> None:
        """Refuse every parameter an optimizer updates that no tracked module owns (a CLIP-style
        ``logit_scale``, a module not passed to Run): its moments would be saved and its value
        nowhere, so a resume would restart it from its initial value (issue 17). An error, not a
        warning: there is no run in which that resume is exact."""
        for c in self:
            untracked = getattr(c.adapter, "untracked", None)
            lost: list[tuple[int, list[int]]] = untracked() if untracked is not None else []
            if not lost:
                continue
            group = [gi for gi, g in enumerate(c.obj.param_groups) for _ in g["params"]]
            where = ", ".join(f"#{i} (shape {shape}, group {group[i]})" for i, shape in lost[:5])
            more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
            raise StateError(
                f"optimizer {c.name!r} updates {len(lost)} parameter(s) that no tracked module "
                f"owns: {where}{more}; their values would not be saved, so a resume would "
                "restart them from their initial values. Pass the module that owns them to Run, "
                "or hold them in a module (e.g. torch.nn.ParameterDict) that you pass"
            )

    def restore(
        self, names: Iterable[str], trees: Mapping[str, Any], tensors: dict[str, torch.Tensor]
    ) -> None:
        """``load_state_dict`` on every named component; rank-local (RNG-like) ones last."""
        ordered = sorted(names, key=lambda n: self._items[n].rank_local)
        for name in ordered:
            c = self._items[name]
            state = _nested.join(trees[name], tensors)
            try:
                c.adapter.load_state_dict(state)
            except StateError:
                raise
            except (KeyError, ValueError, RuntimeError, TypeError, AttributeError, IndexError) as e:
                raise StateError(f"component {name!r} could not load its state: {e}") from e


class NumpyRandomStateState:
    """A legacy ``numpy.random.RandomState``: its MT19937 key, position and cached Gaussian,
    as JSON integers and a float (nothing pickled)."""

    kind = "generator"

    def __init__(self, generator: np.random.RandomState) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        s = self.generator.get_state(legacy=False)
        return {
            "bit_generator": s["bit_generator"],
            "key": [int(k) for k in s["state"]["key"]],
            "pos": int(s["state"]["pos"]),
            "has_gauss": int(s["has_gauss"]),
            "gauss": float(s["gauss"]),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.generator.set_state(
            {
                "bit_generator": sd["bit_generator"],
                "state": {"key": np.asarray(sd["key"], dtype=np.uint32), "pos": int(sd["pos"])},
                "has_gauss": int(sd["has_gauss"]),
                "gauss": float(sd["gauss"]),
            }
        )


def _loadable_in_place(t: torch.Tensor) -> bool:
    # Loading writes through the tensor; only plain dense CPU/accelerator tensors qualify.
    return t.layout == torch.strided and not t.requires_grad and t.is_contiguous()


class _LiveModules(Mapping[str, torch.nn.Module]):
    """The registry's modules as they are now (a callback may swap the model)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def __getitem__(self, key: str) -> torch.nn.Module:
        return self._registry.modules()[key]

    def __iter__(self):
        return iter(self._registry.modules())

    def __len__(self) -> int:
        return len(self._registry.modules())
