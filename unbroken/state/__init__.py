"""State layer: the Stateful protocol, adapters, RNG capture, counters, EMA and the registry.

The names are imported lazily: decoding a checkpoint's JSON state (``unbroken inspect``) goes
through _tree only, and never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._counters import Counters
    from ._ema import EMA
    from ._protocol import Stateful
    from ._registry import Component, Payload, Registry, TensorInfo, local_prefix
    from ._rng import GlobalRNG

_LAZY = {
    "Component": "._registry",
    "Counters": "._counters",
    "EMA": "._ema",
    "GlobalRNG": "._rng",
    "Payload": "._registry",
    "Registry": "._registry",
    "Stateful": "._protocol",
    "TensorInfo": "._registry",
    "local_prefix": "._registry",
}

__all__ = [
    "EMA",
    "Component",
    "Counters",
    "GlobalRNG",
    "Payload",
    "Registry",
    "Stateful",
    "TensorInfo",
    "local_prefix",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
