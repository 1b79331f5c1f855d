"""A small but complete training script used by the golden resume tests.

MLP with dropout, AdamW + warmup/cosine LambdaLR, gradient clipping, EMA, optional GradScaler
and gradient accumulation, a noisy dataset (augmentation randomness), 0..N loader workers.
``--signal-at K --signal TERM|KILL`` makes the process signal itself right after step K
(K=0: before the first step), as an external preemption would.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import unbroken

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests import faults  # noqa: E402
from tests.scripts._oracle import Oracle  # noqa: E402

faults.install_from_env()  # a fault plan, when the test that launched this asked for one


class Noisy(torch.utils.data.Dataset):
    """y = x @ w + noise; the noise is the 'augmentation' that must replay exactly."""

    def __init__(self, n: int, protocol: bool, noise: str = "torch", late: int = -1) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)
        self.noise, self.late = noise, late
        if protocol:
            self.get_sample = self._get_sample

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        # Global RNG inside a worker or the main process: unbroken seeds it per sample.
        if self.noise == "numpy":
            noise = torch.from_numpy(np.random.randn(8).astype(np.float32))
        elif self.noise == "python" or (self.noise == "late" and i == self.late):
            noise = torch.tensor([random.gauss(0.0, 1.0) for _ in range(8)])
        elif self.noise == "late":
            noise = torch.zeros(8)  # no global stream drawn from
        else:
            noise = torch.randn(8)
        return self.x[i] + 0.1 * noise, self.y[i]

    def _get_sample(self, i: int, generator: torch.Generator):
        return self.x[i] + 0.1 * torch.randn(8, generator=generator), self.y[i]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--batch-size-from", default=None, help="STEP:SIZE, the batch size from that step on"
    )
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--scaler", action="store_true")
    p.add_argument("--protocol", action="store_true", help="dataset.get_sample(i, generator)")
    p.add_argument(
        "--noise",
        choices=["torch", "numpy", "python", "late"],
        default="torch",
        help="the global stream the dataset draws from (late: Python's, for one sample only, "
        "first fetched at step 4)",
    )
    p.add_argument("--n", type=int, default=96)
    p.add_argument("--style", choices=["loop", "epochs"], default="loop")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--epoch-end-save", action="store_true")
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal", choices=["TERM", "KILL", "INT", "USR1"], default="KILL")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (kill tests)")
    p.add_argument("--snapshot-every", type=int, default=None)
    p.add_argument(
        "--meddle",
        choices=["clamp", "scale", "assign"],
        default=None,
        help="change the parameters through .data before each forward (clamp: WGAN's weight "
        "clipping, p.data.clamp_; scale: p.data.mul_; assign: p.data = ...), then sleep "
        "--step-sleep there (in a snapshot's copy window) instead of after run.step()",
    )
    p.add_argument("--snapshot-copy", choices=["step", "background"], default=None)
    p.add_argument(
        "--say-watch",
        action="store_true",
        help="print after each step whether torch.Tensor.data is patched (the snapshots' watch)",
    )
    p.add_argument("--mark", default=None, help="append this process's pid to FILE before Run()")
    a = p.parse_args()
    if a.mark:  # a side effect before Run(), as a download or a print would be
        with open(a.mark, "a") as f:
            f.write(f"{os.getpid()}\n")

    unbroken.seed_everything(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warm = 5
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps))
        ),
    )
    ema = unbroken.EMA(model, decay=0.9)
    loader = unbroken.MapLoader(
        # The late sample: position 27 of epoch 0's order, i.e. in the 4th batch of 8.
        Noisy(a.n, a.protocol, a.noise, int(unbroken.data.epoch_order(7, 0, a.n, True)[27])),
        batch_size=a.batch_size,
        shuffle=True,
        seed=7,
        num_workers=a.workers,
        persistent_workers=a.persistent,
    )
    comps = dict(model=model, optimizer=opt, scheduler=sched, ema=ema, loader=loader)
    scaler = None
    if a.scaler:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        comps["scaler"] = scaler
    run = unbroken.Run(
        a.run_dir,
        **comps,
        save_every=a.save_every,
        max_steps=a.steps,
        save_on_epoch_end=a.epoch_end_save,
        async_save=a.async_save,
        progress=False,
        **({"snapshot_every": a.snapshot_every} if a.snapshot_every is not None else {}),
        **({"snapshot_copy": a.snapshot_copy} if a.snapshot_copy is not None else {}),
    )

    def batch_size_for(step: int) -> int:
        if a.batch_size_from:
            at, size = (int(v) for v in a.batch_size_from.split(":"))
            if step >= at:
                return size
        return a.batch_size

    oracle = Oracle(a.run_dir, run.counters.step)
    loader.batch_size = batch_size_for(run.counters.step)
    if a.signal_at == 0:
        os.kill(os.getpid(), getattr(signal, "SIG" + a.signal))
    samples: list[int] = []

    def meddle() -> None:
        for prm in model.parameters():
            if a.meddle == "clamp":
                prm.data.clamp_(-0.3, 0.3)
            elif a.meddle == "scale":
                prm.data.mul_(0.999)
            else:
                prm.data = prm.data * 0.999

    def train_step(micro: list) -> None:
        if a.meddle:
            meddle()
            if a.step_sleep:
                time.sleep(a.step_sleep)
        total = 0.0
        for x, y in micro:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
                loss = F.mse_loss(model(x).float(), y) / len(micro)
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.item()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        ema.update()
        oracle.step(run.counters.step + 1, total)  # before run.step(), which may stop here
        run.step(
            loss=total,
            lr=sched.get_last_lr()[0],
            batch_size=loader.batch_size,
            samples=list(samples),
        )
        samples.clear()
        if a.say_watch:
            patched = "data" in vars(torch.Tensor) or "numpy" in vars(torch.Tensor)
            print(f"toy: step {run.counters.step} Tensor.data patched: {patched}", flush=True)
        if a.step_sleep and not a.meddle:
            time.sleep(a.step_sleep)  # a slower step: an outside kill lands where it is aimed
        loader.batch_size = batch_size_for(run.counters.step)
        if a.signal_at is not None and run.counters.step == a.signal_at:
            os.kill(os.getpid(), getattr(signal, "SIG" + a.signal))

    micro: list = []
    if a.style == "loop":
        for batch in run.loop(loader):
            micro.append(batch)
            samples.extend(loader.last_indices)
            if len(micro) == a.accum:
                train_step(micro)
                micro = []
    else:
        for _epoch in run.epochs(10**6):
            for batch in loader:
                micro.append(batch)
                samples.extend(loader.last_indices)
                if len(micro) == a.accum:
                    train_step(micro)
                    micro = []
                if run.done:
                    break
    oracle.finish(**{k: v for k, v in comps.items() if k != "loader"})


if __name__ == "__main__":
    main()
