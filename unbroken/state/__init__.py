"""State layer: the Stateful protocol, adapters, RNG capture, counters, EMA and the registry."""

from ._counters import Counters
from ._ema import EMA
from ._protocol import Stateful
from ._registry import Component, Payload, Registry, TensorInfo, local_prefix
from ._rng import GlobalRNG

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
