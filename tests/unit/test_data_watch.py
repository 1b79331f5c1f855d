"""The watch of ``Tensor.data`` (train/_data_watch.py): a patch of a torch attribute, checked.

The background copy of in-memory snapshots relies on it to see changes made through
``p.data`` (a tensor with its own version counter). It replaces ``torch.Tensor.data`` with a
property that delegates to ``torch._C.TensorBase.data``: should torch move or redefine that
attribute, the first test fails here, loudly (and a run copies its snapshots in the step's
path, with a warning, instead of in the background unwatched).
"""

from __future__ import annotations

from typing import Any

import torch

from unbroken.train import _data_watch


def test_torch_resolves_tensor_data_from_tensorbase() -> None:
    assert _data_watch.patchable() is None
    assert _data_watch.install() is None
    assert isinstance(torch.Tensor.__dict__["data"], property)
    assert type(torch._C.TensorBase.__dict__["data"]).__name__ == "getset_descriptor"
    owners = [c for c in torch.nn.Parameter.__mro__ if "data" in c.__dict__]
    assert owners == [torch.Tensor, torch._C.TensorBase], owners


def test_data_behaves_as_torch_s_own_once_patched() -> None:
    assert _data_watch.install() is None
    orig = torch._C.TensorBase.__dict__["data"]
    p = torch.nn.Parameter(torch.randn(3, 2))
    d = p.data
    assert type(d) is torch.Tensor and type(orig.__get__(p)) is torch.Tensor
    assert not d.requires_grad and d.data_ptr() == p.data_ptr()
    d.mul_(2)  # its own version counter: the parameter's does not move
    assert d._version == 1 and p._version == 0
    loss = (p * p).sum()  # the parameter saved for backward: .data changes do not trip it
    p.data.add_(1)
    loss.backward()
    new = torch.zeros(3, 2)
    p.data = new
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert p.data_ptr() == new.data_ptr() and torch.equal(p.detach(), new)


class _Logged(torch.Tensor):
    seen: list[Any] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_torch_function_subclass_still_gets_data() -> None:
    assert _data_watch.install() is None
    x = torch.randn(4).as_subclass(_Logged)
    _Logged.seen.clear()
    d = x.data
    assert type(d) is _Logged and torch.equal(
        d.as_subclass(torch.Tensor), x.as_subclass(torch.Tensor)
    )
    assert _Logged.seen, "__torch_function__ was not called for .data"
    x.data = torch.ones(4)
    assert torch.equal(x.as_subclass(torch.Tensor), torch.ones(4))
    _Logged.seen.clear()
    a = x.numpy()
    assert a.tolist() == [1.0] * 4 and _Logged.seen, "__torch_function__ was not called for numpy"


def test_numpy_behaves_as_torch_s_own_once_patched() -> None:
    import numpy as np

    assert _data_watch.install() is None
    t = torch.arange(4.0)
    a = t.numpy()
    a[0] = 7.0  # shares the memory, moves no counter
    assert t[0].item() == 7.0 and t._version == 0
    assert np.asarray(t).tolist() == [7.0, 1.0, 2.0, 3.0]
    assert t.numpy(force=True).tolist() == [7.0, 1.0, 2.0, 3.0]
    p = torch.nn.Parameter(torch.zeros(2))
    try:
        p.numpy()
    except RuntimeError as e:
        assert "requires grad" in str(e)
    else:
        raise AssertionError("numpy() of a tensor that requires grad did not raise")


class _Job:
    def __init__(self) -> None:
        self.watched: list[tuple[list[str], torch.Tensor]] = []
        self.marked: list[list[str]] = []

    def watch_alias(self, keys: list[str], alias: torch.Tensor) -> None:
        self.watched.append((keys, alias))

    def mark_changed(self, keys: list[str]) -> None:
        self.marked.append(keys)


def test_the_watch_sees_data_of_what_is_copied_and_only_that() -> None:
    assert _data_watch.install() is None
    p = torch.nn.Parameter(torch.randn(4, 4))
    other = torch.randn(4)
    before = p.data  # made before the watch began: found by its scan
    w, job = _data_watch.Watch(), _Job()
    copied: list = [("w", p.detach(), p._version)]
    w.begin(job, [(p, p.data_ptr())], copied, [p.data_ptr()])
    try:
        assert any(t is before for _, t, _ in copied)  # its version is compared at the judge
        other.data.mul_(2)
        other.data = torch.zeros(4)
        assert job.watched == [] and job.marked == []
        a = p.data
        assert job.watched == [(["w"], a)]
        p[1].data.mul_(1)  # a view of the parameter, then .data
        assert len(job.watched) == 2
        p.data = torch.zeros(4, 4)
        assert job.marked == [["w"]]
        other.numpy()
        assert job.marked == [["w"]] and not w.exposed
        before.numpy()  # an alias found by the scan
        assert job.marked == [["w"], ["w"]] and w.exposed == {"w"}
        w.end()
        p.data.mul_(1)  # outside the window: remembered for the next one, not this job's
        assert len(job.watched) == 2
    finally:
        w.close()
    assert w not in _data_watch._WATCHES
