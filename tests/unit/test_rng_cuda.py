"""CUDA generators per rank, per device: the mapping (pure) and the capture/restore wiring with
only the CUDA boundary stubbed (four functions in state/_rng.py); the real thing runs when
CUDA is present."""

from __future__ import annotations

import logging

import pytest
import torch

from unbroken import StateError
from unbroken.state import _rng
from unbroken.state._rng import GlobalRNG, cuda_plan

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def v2(*states: bytes) -> dict:
    return {"version": 1, "cuda": list(states), "cuda_devices": list(range(len(states)))}


def test_same_world_maps_the_rank_generator_onto_its_device():
    # rank 3 of a node used device 3; resumed as rank 3 it uses device 3 again
    assert cuda_plan(v2(A), [3], True) == [(3, A)]


def test_another_gpu_count_maps_by_rank_not_by_index():
    # saved by a rank on device 5 of 8, resumed on a node where that rank uses device 1 of 2
    assert cuda_plan(v2(A), [1], True) == [(1, A)]


def test_several_devices_map_in_order():
    assert cuda_plan(v2(A, B), [4, 6], True) == [(4, A), (6, B)]
    with pytest.raises(StateError, match="2 device.*uses 1 now"):
        cuda_plan(v2(A, B), [0], True)


def test_cuda_saved_but_absent_is_named():
    with pytest.raises(StateError, match="CUDA is not available.*track_rng=False"):
        cuda_plan(v2(A), None, False)


def test_cpu_checkpoint_resumed_on_cuda_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="unbroken.state"):
        assert cuda_plan({"version": 1, "cuda": []}, [0], True) == []
    assert "no CUDA generator state" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unbroken.state"):
        assert cuda_plan({"version": 1, "cuda": []}, None, False) == []
    assert caplog.text == ""


def test_older_states_took_every_device_by_index():
    old = {"version": 1, "cuda": [A, B, C]}
    assert cuda_plan(old, [2], True) == [(2, C)]
    with pytest.raises(StateError, match="3 device.*uses device 5"):
        cuda_plan(old, [5], True)


class FakeCuda:
    """The CUDA boundary: which device is current, and each device's generator bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, current: int, in_use: bool = True):
        self.current, self.gens, self.reads = current, {}, []
        monkeypatch.setattr(_rng, "_cuda_in_use", lambda: in_use)
        monkeypatch.setattr(_rng, "_cuda_current", lambda: self.current)
        monkeypatch.setattr(_rng, "_cuda_get", self.get)
        monkeypatch.setattr(_rng, "_cuda_set", self.gens.__setitem__)

    def get(self, device: int) -> bytes:
        self.reads.append(device)
        return self.gens.get(device, bytes([device]) * 16)


def test_capture_reads_only_the_current_device(monkeypatch):
    cuda = FakeCuda(monkeypatch, current=2)
    state = GlobalRNG().state_dict()
    assert cuda.reads == [2], "another device's generator was read (a context created there)"
    assert state["cuda"] == [bytes([2]) * 16] and state["cuda_devices"] == [2]


def test_round_trip_onto_another_device(monkeypatch):
    cuda = FakeCuda(monkeypatch, current=5)
    state = GlobalRNG().state_dict()
    cuda2 = FakeCuda(monkeypatch, current=0)
    GlobalRNG().load_state_dict(state)
    assert cuda2.gens == {0: bytes([5]) * 16}
    assert cuda.reads == [5]


def test_explicit_devices(monkeypatch):
    cuda = FakeCuda(monkeypatch, current=0)
    state = GlobalRNG(devices=[1, 3]).state_dict()
    assert cuda.reads == [1, 3]
    GlobalRNG(devices=[0, 2]).load_state_dict(state)
    assert cuda.gens == {0: bytes([1]) * 16, 2: bytes([3]) * 16}


def test_cpu_only_state_has_no_cuda_and_restores(monkeypatch):
    FakeCuda(monkeypatch, current=0, in_use=False)
    state = GlobalRNG().state_dict()
    assert state["cuda"] == [] and "cuda_devices" not in state
    GlobalRNG().load_state_dict(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_generator_round_trip():
    torch.cuda.init()
    dev = torch.cuda.current_device()
    torch.randn(4, device="cuda")
    state = GlobalRNG().state_dict()
    want = torch.randn(8, device="cuda")
    torch.cuda.manual_seed(123)
    GlobalRNG().load_state_dict(state)
    assert torch.equal(torch.randn(8, device="cuda"), want)
    assert state["cuda_devices"] == [dev]


def test_cuda_states_read_only_this_ranks_devices(monkeypatch):
    """What the loop-start audit fingerprints: the current device's generator alone."""
    cuda = FakeCuda(monkeypatch, current=3)
    assert _rng.cuda_states() == [bytes([3]) * 16] and cuda.reads == [3]
    assert _rng.cuda_states([1]) == [bytes([1]) * 16]
    FakeCuda(monkeypatch, current=0, in_use=False)
    assert _rng.cuda_states() == []
