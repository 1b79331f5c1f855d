"""Canonical micro-shards against a reference computed in one process, every rank alike.

Each rank computes, by itself, all K shards' gradients with plain backward calls and adds them
in shard order (``(((g0 + g1) + g2) + ...) / K``, a shard that left a parameter without a
gradient counting as +0.0): the canonical contract, written out without any exchange. Then it
runs the same steps through ``CanonicalGradients`` on W ranks and requires ``p.grad`` to match
bit for bit. What the steps cover: float32 and bfloat16 parameters (two flat buffers), a
parameter some shards leave without a gradient and one no shard touches, gradients of -0.0,
unsynchronised calls (accumulation), two ``backward`` calls in one shard, gradients already in
``p.grad``, and buckets smaller than a parameter (``--bucket``). Rank 0 writes the gradients to
``--out`` so that world sizes can be compared with each other.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import unbroken


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 40)
        self.low = torch.nn.Parameter(torch.randn(40, 5).bfloat16())
        self.rare = torch.nn.Linear(6, 5)  # only in shards whose first sample is marked
        self.never = torch.nn.Parameter(torch.randn(3))  # no shard uses it
        self.b = torch.nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))  # relu: exact zeros, and -0.0 gradients through the mask
        out = self.b(h) + (h.bfloat16() @ self.low).float()
        if bool(x[0, 0] > 1.5):
            out = out + self.rare(x)
        return out * -0.0 if bool(x[0, 1] > 2.5) else out


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x), y)


def batches(k: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        x, y = torch.randn(2 * k, 6, generator=g), torch.randn(2 * k, 5, generator=g)
        x[::4, 0] = 2.0  # marks: some shards use `rare`
        x[2::6, 1] = 3.0  # some shards' outputs are multiplied by -0.0
        out.append((x, y))
    return out


# Per step: (sync, backward calls per shard); the first two steps accumulate into the third.
# Two calls in a shard turn the overlap off for good (the gradients are summed after each
# shard); --single keeps one call a shard, so every synchronised step overlaps.
PLAN = [(False, 1), (False, 2), (True, 1), (True, 2), (True, 1)]
SINGLE = [(False, 1), (False, 1), (True, 1), (True, 1), (False, 1), (True, 1)]


def reference(k: int, plan: list[tuple[bool, int]]) -> list[dict[str, torch.Tensor]]:
    """What p.grad holds after each synchronised call, computed in one process."""
    net = Net()
    params = dict(net.named_parameters())
    rows: list[dict[str, torch.Tensor | None]] = [dict.fromkeys(params) for _ in range(k)]
    held = dict.fromkeys(params)
    results = []
    for (sync, calls), (x, y) in zip(plan, batches(k, len(plan)), strict=True):
        size = len(x) // k
        for s in range(k):
            xs, ys = x[s * size : (s + 1) * size], y[s * size : (s + 1) * size]
            for p in params.values():
                p.grad = None
            for _ in range(calls):
                loss_of(net, xs, ys).backward()
            for name, p in params.items():
                if p.grad is not None:
                    old = rows[s][name]
                    rows[s][name] = p.grad.clone() if old is None else old + p.grad
        if not sync:
            continue
        now = {}
        for name, p in params.items():
            got = [rows[s][name] for s in range(k)]
            if all(g is None for g in got):
                if held[name] is not None:
                    now[name] = held[name]
                continue
            acc = got[0].clone() if got[0] is not None else torch.zeros_like(p)
            for g in got[1:]:
                acc = acc + (g if g is not None else torch.zeros_like(p))
            acc = acc / k
            now[name] = acc if held[name] is None else held[name] + acc
        held = {name: now.get(name) for name in params}  # p.grad is never zeroed here
        results.append({n: g.clone() for n, g in now.items()})
        rows = [dict.fromkeys(params) for _ in range(k)]
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--bucket", type=int, default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--single", action="store_true", help="one backward() a shard: overlapped")
    a = p.parse_args()
    if a.bucket:
        from unbroken.train import _canonical

        _canonical._BUCKET = a.bucket
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    plan = SINGLE if a.single else PLAN
    want = reference(a.shards, plan)
    net = Net()
    canon = unbroken.train.CanonicalGradients(net, a.shards)
    got = []
    for (sync, calls), (x, y) in zip(plan, batches(a.shards, len(plan)), strict=True):
        local = len(x) // world
        xr, yr = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        for xs, ys in canon.shards(xr, yr, sync=sync):
            for _ in range(calls):
                canon.backward(loss_of(net, xs, ys))
        if sync:
            got.append({n: q.grad.clone() for n, q in net.named_parameters() if q.grad is not None})
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), (step, sorted(g), sorted(w))
        for name in w:
            # torch.equal takes -0.0 for +0.0: the sign bits are compared too.
            same = torch.equal(g[name], w[name]) and torch.equal(
                g[name].signbit(), w[name].signbit()
            )
            assert same, f"rank {rank} step {step} {name}: not the reference's bits"
    assert canon._several is not a.single  # the path meant was the path taken
    assert "never" not in got[-1] and "rare.weight" in got[-1]
    if rank == 0 and a.out:
        flat = {f"{s}/{n}": t for s, d in enumerate(got) for n, t in d.items()}
        save_file(flat, a.out)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
