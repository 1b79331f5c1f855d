"""Capture and restore every global random stream of a process, as JSON-safe values.

Python's and NumPy's states are plain integers (no pickled tuples); torch's are raw bytes.
Capturing never draws a number, so taking a checkpoint leaves every stream where it was.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .._errors import StateError

RNG_VERSION = 1


def capture() -> dict[str, Any]:
    """The state of Python's, NumPy's, torch's CPU and (when present) CUDA global generators."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "version": RNG_VERSION,
        "python": [py_version, list(py_state), py_gauss],
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": [int(k) for k in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch_cpu": torch.get_rng_state().numpy().tobytes(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture`; raises StateError naming the stream that does not fit."""
    if state.get("version") != RNG_VERSION:
        raise StateError(f"rng state has version {state.get('version')!r}, expected {RNG_VERSION}")
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_s = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_s["bit_generator"],
            "state": {"key": np.asarray(np_s["key"], dtype=np.uint32), "pos": np_s["pos"]},
            "has_gauss": np_s["has_gauss"],
            "gauss": np_s["gauss"],
        }
    )
    torch.set_rng_state(_bytes_tensor(state["torch_cpu"]))
    cuda = state.get("cuda") or []
    if cuda:
        if not torch.cuda.is_available():
            raise StateError(
                "rng: the checkpoint holds CUDA generator states but CUDA is not available; "
                "resume on a machine with CUDA, or untrack the rng component"
            )
        if len(cuda) != torch.cuda.device_count():
            raise StateError(
                f"rng: the checkpoint holds {len(cuda)} CUDA generator states but "
                f"{torch.cuda.device_count()} devices are visible"
            )
        torch.cuda.set_rng_state_all([_bytes_tensor(s) for s in cuda])


def _bytes_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class GlobalRNG:
    """The process-wide random streams as a Stateful component (rank-local)."""

    rank_local = True
    kind = "rng"

    def state_dict(self) -> dict[str, Any]:
        return capture()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore(state_dict)
