"""Adapters that give every kind of tracked object the same Stateful face.

The registry wraps what the user hands in: modules load strictly, optimizers are keyed by
parameter *name* (so state survives resharding and model growth), and random generators of
torch, NumPy and Python become components too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import StateError
from ._nested import escape
from ._stateful import Stateful


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / ``torch.compile`` wrappers: checkpoints use its names, so a
    checkpoint saved with a wrapper loads without one (and on another world size)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod") and isinstance(module._orig_mod, torch.nn.Module):
            module = module._orig_mod
        else:
            return module


class ModuleState:
    """An ``nn.Module``: ``state_dict`` tensors share storage with the live parameters."""

    kind = "module"

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return unwrap(self.module).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        result = unwrap(self.module).load_state_dict(state_dict, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise StateError(
                f"model keys differ from the checkpoint: missing {result.missing_keys}, "
                f"unexpected {result.unexpected_keys}; build the same model before resuming"
            )


class OptimizerState:
    """A ``torch.optim.Optimizer`` whose state is keyed by parameter name.

    Plain ``Optimizer.state_dict()`` keys state by position; names make the format independent
    of parameter order and let DCP reshard it. Parameters found in no tracked module fall back
    to ``#<position>`` names.
    """

    kind = "optimizer"

    def __init__(self, optimizer: torch.optim.Optimizer, modules: Mapping[str, torch.nn.Module]):
        self.optimizer = optimizer
        self.modules = modules

    def _names(self) -> list[str]:
        by_id: dict[int, str] = {}
        owners = [m for m in self.modules.values()]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        # Prefix with the component name only when the parameters span several modules.
        for comp, module in self.modules.items():
            for name, p in unwrap(module).named_parameters(remove_duplicate=False):
                by_id.setdefault(id(p), name if len(owners) == 1 else f"{comp}.{name}")
        if len(owners) > 1:
            spanning = {n.split(".", 1)[0] for p in params if (n := by_id.get(id(p)))}
            if len(spanning) == 1:
                prefix = next(iter(spanning)) + "."
                by_id = {k: v.removeprefix(prefix) for k, v in by_id.items()}
        names = [by_id.get(id(p), f"#{i}") for i, p in enumerate(params)]
        if len(set(names)) != len(names):
            names = [f"#{i}" for i in range(len(params))]
        return names

    def untracked(self) -> list[tuple[int, list[int]]]:
        """(position, shape) of every parameter this optimizer updates that no tracked module
        owns: its moments would be saved, its value nowhere (it would restart from its
        initial value after a resume)."""
        owned = {id(p) for m in self.modules.values() for p in unwrap(m).parameters(recurse=True)}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return [(i, list(p.shape)) for i, p in enumerate(params) if id(p) not in owned]

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        names = self._names()
        return {
            "state": {names[i]: s for i, s in sd["state"].items()},
            "param_groups": [
                {**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]
            ],
        }

    def templates(self) -> Callable[[str, tuple[int, ...], torch.dtype], Any]:
        """``make(path, shape, dtype)``: a load target for a saved state tensor the optimizer
        does not hold yet, or None for a plain tensor.

        For a sharded (DTensor) parameter, per-parameter state of the parameter's shape must be
        sharded like it, so that DCP reshards into it. The name lookup is built once, here.
        """
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        by_segment = {escape(n): p for n, p in zip(self._names(), params, strict=True)}

        def make(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
            parts = path.strip("/").split("/")
            if len(parts) != 3 or parts[0] != "state":
                return None
            p = by_segment.get(parts[1])
            if p is None or tuple(p.shape) != shape or not _is_dtensor(p):
                return None
            return torch.empty_like(p.detach(), dtype=dtype)

        return make

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        names = self._names()
        index = {n: i for i, n in enumerate(names)}
        saved = [n for g in state_dict["param_groups"] for n in g["params"]]
        if sorted(saved) != sorted(names):
            missing = sorted(set(names) - set(saved))
            extra = sorted(set(saved) - set(names))
            raise StateError(
                f"optimizer parameters differ from the checkpoint: not in checkpoint {missing}, "
                f"only in checkpoint {extra}; build the same optimizer before resuming"
            )
        self.optimizer.load_state_dict(
            {
                "state": {index[n]: s for n, s in state_dict["state"].items()},
                "param_groups": [
                    {**g, "params": [index[n] for n in g["params"]]}
                    for g in state_dict["param_groups"]
                ],
            }
        )


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


class TorchGeneratorState:
    kind = "generator"

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.get_state().numpy().tobytes()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raw = bytearray(state_dict["state"])
        self.generator.set_state(torch.frombuffer(raw, dtype=torch.uint8))


class NumpyGeneratorState:
    kind = "generator"

    def __init__(self, generator: np.random.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.generator.bit_generator.state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.generator.bit_generator.state = state_dict["state"]


class PythonRandomState:
    kind = "generator"

    def __init__(self, generator: random.Random) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        version, state, gauss = self.generator.getstate()
        return {"state": [version, list(state), gauss]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        version, state, gauss = state_dict["state"]
        self.generator.setstate((version, tuple(state), gauss))


class GenericState:
    """Any user object that already is Stateful."""

    kind = "stateful"

    def __init__(self, obj: Stateful) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)
