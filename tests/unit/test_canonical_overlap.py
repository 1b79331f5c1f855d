"""Canonical micro-shards' overlapped sum, in one process: what it refuses and what it keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import unbroken


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _grads(overlap: bool, calls: int) -> list[torch.Tensor]:
    net = _net()
    canon = unbroken.train.CanonicalGradients(net, 3, overlap=overlap)
    g = torch.Generator().manual_seed(1)
    for sync in (False, True, True):
        x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
        for xs, ys in canon.shards(x, y, sync=sync):
            for _ in range(calls):
                canon.backward(F.mse_loss(net(xs), ys))
    return [p.grad for p in net.parameters()]


def test_overlap_on_and_off_give_the_same_bits() -> None:
    on, off = _grads(True, 1), _grads(False, 1)
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    # Several backward() calls a shard, seen before the last shard: summed after each shard.
    assert all(torch.equal(a, b) for a, b in zip(_grads(True, 2), _grads(False, 2), strict=True))


def test_a_second_backward_in_an_overlapped_last_shard_is_refused() -> None:
    net = _net()
    canon = unbroken.train.CanonicalGradients(net, 1)
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    with pytest.raises(unbroken.ConfigError, match="overlap=False"):
        for xs, ys in canon.shards(x, y):
            canon.backward(F.mse_loss(net(xs), ys))
            canon.backward(F.mse_loss(net(xs), ys))
    canon = unbroken.train.CanonicalGradients(net, 1, overlap=False)
    for xs, ys in canon.shards(x, y):
        canon.backward(F.mse_loss(net(xs), ys))
        canon.backward(F.mse_loss(net(xs), ys))
    assert all(p.grad is not None for p in net.parameters())


def test_a_gradient_that_grows_after_its_bucket_went_is_refused() -> None:
    """A weight shared by two reentrant checkpoints is accumulated twice in one backward: the
    second time after its bucket was summed. That would change the bits; it is refused."""
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    net = torch.nn.ModuleDict({"shared": shared, "head": torch.nn.Linear(4, 1)})

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(shared, x, use_reentrant=True)
        h = checkpoint(shared, torch.tanh(h), use_reentrant=True)
        return net["head"](h)

    x = torch.randn(2, 4, requires_grad=True)
    canon = unbroken.train.CanonicalGradients(net, 1)
    with pytest.raises(unbroken.ConfigError, match="grew again after it was sent"):
        for (xs,) in canon.shards((x,)):
            canon.backward(forward(xs).sum())
    canon = unbroken.train.CanonicalGradients(net, 1, overlap=False)
    for (xs,) in canon.shards((x,)):
        canon.backward(forward(xs).sum())
