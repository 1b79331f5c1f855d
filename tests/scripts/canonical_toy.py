"""The toy run of tests/e2e/test_canonical.py: DDP (gloo) with or without canonical micro-shards.

``--shards K`` turns the mode on (0: plain DDP, whose gradient all-reduce sums in an order fixed
by the world size). Composes dropout, AdamW, a warmup-cosine ``lr`` setting, gradient
accumulation (``--accum``), bf16 autocast with a GradScaler (``--amp``), clipping and an EMA.
``--signal-at K [--signal TERM]``: every rank SIGKILLs (SIGTERMs) itself after step K.
``--bucket N``: exchange the gradients N elements at a time (the toy's 500 in several buckets).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unbroken


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def get_sample(self, i: int, generator: torch.Generator):
        return self.x[i] + 0.1 * torch.randn(8, generator=generator), self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--shards", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal", default="KILL", help="KILL or TERM (to every rank)")
    p.add_argument("--bucket", type=int, default=None, help="gradient elements per exchange")
    a = p.parse_args()
    if a.bucket:
        from unbroken.train import _canonical

        _canonical._BUCKET = a.bucket  # several buckets even for this tiny model

    torch.set_num_threads(1)
    rank, world = unbroken.init_distributed()
    unbroken.seed_everything(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.GELU(),
        torch.nn.Dropout(a.dropout),
        torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 3),
    )
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=a.amp, init_scale=2.0**10)
    ema = unbroken.EMA(model, decay=0.9)
    loader = unbroken.MapLoader(Noisy(72), batch_size=a.batch_size, seed=7)
    canon = unbroken.train.CanonicalGradients(net, a.shards, scaler=scaler) if a.shards else None
    settings = unbroken.train.Settings(
        lr=unbroken.train.WarmupCosine(peak=3e-3, warmup=min(3, a.steps - 1), total=a.steps),
        grad_accum=a.accum,
    )
    run = unbroken.Run(
        a.run_dir,
        model=net,
        optimizer=opt,
        scaler=scaler,
        ema=ema,
        loader=loader,
        **({"canonical": canon} if canon is not None else {}),
        settings=settings,
        save_every=a.save_every,
        max_steps=a.steps,
        progress=False,
    )

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.amp):
            out = net(x)
        return F.mse_loss(out.float(), y.expand(-1, 3)) / a.accum

    for x, y in run.loop(loader):
        if canon is not None:
            for xs, ys in canon.shards(x, y, sync=not run.accumulating):
                canon.backward(loss_of(xs, ys))
            loss = canon.loss
        else:
            loss = loss_of(x, y)
            scaler.scale(loss).backward()
        if run.accumulating:
            continue
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        ema.update()
        run.step(loss=loss, samples=list(loader.last_indices))
        if a.signal_at is not None and run.counters.step == a.signal_at:
            os.kill(os.getpid(), getattr(signal, "SIG" + a.signal))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
