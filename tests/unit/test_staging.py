"""Host staging of a state's tensors (store/_host_buffers.py): reused buffers, CPU copies at once;
GPU tensors into pinned buffers on a side stream (run when CUDA is present)."""

from __future__ import annotations

import pytest
import torch

from unbroken.store._host_buffers import Stage

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_copies_are_done_and_buffers_reused():
    stage = Stage()
    a, b = torch.randn(3, 4), torch.arange(5)
    staged = stage.copy(["a", "b"], [a, b])
    assert not staged.pending
    got = staged.wait()
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    assert got[0].data_ptr() != a.data_ptr(), "a copy, not the live tensor"
    a.add_(1)  # training goes on: the staged copy keeps the saved values
    assert not torch.equal(got[0], a)
    again = stage.copy(["a", "b"], [a, b]).wait()
    assert again[0] is got[0] and again[1] is got[1], "buffers are reused from save to save"
    assert torch.equal(again[0], a)
    assert not again[0].is_pinned()


def test_a_changed_shape_or_dtype_gets_a_new_buffer():
    stage = Stage()
    first = stage.copy(["w"], [torch.zeros(4)]).wait()[0]
    grown = stage.copy(["w"], [torch.ones(6)]).wait()[0]
    assert grown is not first and torch.equal(grown, torch.ones(6))
    typed = stage.copy(["w"], [torch.ones(6, dtype=torch.float64)]).wait()[0]
    assert typed.dtype == torch.float64


def test_async_saver_and_slots_use_the_stage(tmp_path):
    """The CPU path end to end: an async save and a slot snapshot hold the tensors' values."""
    from unbroken.store.snapshot._slots import Slots

    slots = Slots(str(tmp_path))
    t = torch.randn(1000)
    chunks, size = slots.write_chunks(str(tmp_path / "data.bin"), [("t", t)])
    assert size == t.numel() * 4
    raw = (tmp_path / "data.bin").read_bytes()
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32), t)


@cuda
def test_gpu_copies_are_pinned_and_the_next_step_cannot_overwrite_them():
    stage = Stage()
    x = torch.randn(1 << 20, device="cuda")
    want = x.cpu()
    staged = stage.copy(["x"], [x])
    x.mul_(0)  # the training stream's next kernel: ordered after the copy
    got = staged.wait()[0]
    assert got.is_pinned() and torch.equal(got, want)


@cuda
def test_gpu_slot_snapshot_equals_the_tensor(tmp_path):
    from unbroken.store.snapshot._slots import Slots

    t = torch.randn(4096, device="cuda")
    slots = Slots(str(tmp_path))
    slots.write_chunks(str(tmp_path / "data.bin"), [("t", t)])
    raw = (tmp_path / "data.bin").read_bytes()
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32), t.cpu())
