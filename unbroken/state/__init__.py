"""State layer: the Stateful protocol, adapters, RNG capture, counters, EMA and the registry.

The names are imported lazily: decoding a checkpoint's JSON state (``unbroken inspect``) goes
through _tree only, and never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:
    from ._counters import Counters
    from ._ema import EMA
    from ._registry import Component, Payload, Registry, TensorInfo, local_prefix
    from ._rng import GlobalRNG
    from ._stateful import Stateful

_LAZY = {
    "Component": "._registry",
    "Counters": "._counters",
    "EMA": "._ema",
    "GlobalRNG": "._rng",
    "Payload": "._registry",
    "Registry": "._registry",
    "Stateful": "._stateful",
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


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)
