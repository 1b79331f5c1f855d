"""Capture and restore every global random stream of a process, as JSON-safe values.

Python's and NumPy's states are plain integers (no pickled tuples); torch's are raw bytes.
Capturing never draws a number, so taking a checkpoint leaves every stream where it was.

CUDA: a rank saves the generator of the device(s) *it* uses (``torch.cuda.current_device()``
unless told others), never ``get_rng_state_all()``: under torchrun every rank sees every GPU of
its node, and reading a device's generator creates a CUDA context there (hundreds of MB each,
on every GPU, from every rank). The state is rank-local, so a resume maps it by rank: rank r's
saved generator goes to the device rank r uses now, whatever its index and however many GPUs
the node has. What cannot be exact is named (:func:`cuda_plan`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import StateError
from ..process import _log

RNG_VERSION = 1
log = _log.get("state")


# ---- the CUDA boundary (the only functions that touch CUDA; tests stub these) -----------------


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def _cuda_in_use() -> bool:
    """CUDA is available and this process has initialised it (a model or tensor on a GPU)."""
    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())


def _cuda_current() -> int:
    return int(torch.cuda.current_device())


def _cuda_get(device: int) -> bytes:
    return bytes(torch.cuda.get_rng_state(device).numpy().tobytes())


def _cuda_set(device: int, state: bytes) -> None:
    torch.cuda.set_rng_state(_bytes_tensor(state), device)


# ---- the mapping (pure) -----------------------------------------------------------------------


def cuda_plan(
    state: dict[str, Any], devices: Sequence[int] | None, available: bool
) -> list[tuple[int, bytes]]:
    """Which saved CUDA generator goes to which device of this rank now: ``[(device, state)]``.

    ``devices``: the devices this rank uses now (None: CUDA not initialised here);
    ``available``: whether CUDA is available at all. Saved generators map onto this rank's
    devices in order (a state without ``cuda_devices``, written by an older unbroken, holds
    every visible device by index: the entries of this rank's device indices are taken).
    Raises StateError when that cannot be exact: CUDA states saved but no CUDA here, or
    another number of devices for this rank.
    """
    saved: list[bytes] = list(state.get("cuda") or [])
    if not saved:
        if devices:
            log.warning(
                "unbroken: the checkpoint holds no CUDA generator state (saved without CUDA); "
                "the CUDA generator of device(s) %s keeps its seed, so CUDA randomness "
                "(dropout on the GPU, say) differs from the run that saved it",
                list(devices),
            )
        return []
    if not available:
        raise StateError(
            "rng: the checkpoint holds CUDA generator states but CUDA is not available; "
            "resume on a machine with CUDA, or untrack the rng component (track_rng=False)"
        )
    mine = list(devices) if devices else [0]
    if "cuda_devices" not in state:
        missing = [d for d in mine if d >= len(saved)]
        if missing:
            raise StateError(
                f"rng: the checkpoint holds the CUDA generators of {len(saved)} device(s) "
                f"(saved by an older unbroken, all visible devices) but this rank uses device "
                f"{missing[0]}; resume with the same GPUs visible, or untrack the rng component"
            )
        return [(d, saved[d]) for d in mine]
    if len(saved) != len(mine):
        raise StateError(
            f"rng: this rank saved the CUDA generators of {len(saved)} device(s) but uses "
            f"{len(mine)} now ({mine}); give GlobalRNG the same number of devices, or untrack "
            "the rng component"
        )
    return list(zip(mine, saved, strict=True))


def capture(devices: Sequence[int] | None = None) -> dict[str, Any]:
    """The state of Python's, NumPy's, torch's CPU and this rank's CUDA generators (those of
    ``devices``, default the current device; none when CUDA is not initialised here)."""
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
    if _cuda_in_use():
        mine = list(devices) if devices is not None else [_cuda_current()]
        state["cuda"] = cuda_states(mine)
        state["cuda_devices"] = mine  # where they came from (and: one generator per device used)
    return state


def cuda_states(devices: Sequence[int] | None = None) -> list[bytes]:
    """The CUDA generator states of ``devices`` (default: the current device; [] when CUDA is
    not initialised here). Never every visible device: reading one creates a context there."""
    if not _cuda_in_use():
        return []
    return [_cuda_get(d) for d in (list(devices) if devices is not None else [_cuda_current()])]


def restore(state: dict[str, Any], devices: Sequence[int] | None = None) -> None:
    """Inverse of :func:`capture`; raises StateError naming the stream that does not fit."""
    if state.get("version") != RNG_VERSION:
        raise StateError(f"rng state has version {state.get('version')!r}, expected {RNG_VERSION}")
    in_use = _cuda_in_use()
    available = in_use or _cuda_available()
    mine = None
    if in_use or (available and state.get("cuda")):
        mine = list(devices) if devices is not None else [_cuda_current()]
    plan = cuda_plan(state, mine, available)
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
    for device, raw in plan:
        _cuda_set(device, raw)


def _bytes_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class GlobalRNG:
    """The process-wide random streams as a Stateful component (rank-local).

    ``devices``: the CUDA devices whose generators this rank saves and restores (default:
    the current device, which is what a rank of torchrun uses).
    """

    rank_local = True
    kind = "rng"

    def __init__(self, devices: Sequence[int] | None = None) -> None:
        self.devices = None if devices is None else [int(d) for d in devices]

    def state_dict(self) -> dict[str, Any]:
        return capture(self.devices)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore(state_dict, self.devices)
