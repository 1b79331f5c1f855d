"""A tiny DDP run (gloo on CPU) for the torchrun tests: ``torchrun --nproc_per_node 2 ...``.

    --run-dir DIR       the run directory (default: $UNBROKEN_RUN_DIR, as verify sets)
    --steps N           steps in all (default 12); --save-every K (default 3)
    --preempt-after K   rank 0 sends itself SIGTERM K steps into every launch (a preemption
                        in each attempt: the ranks agree, save and exit 75)
    --step-sleep S      seconds of sleep per step (room for a test to signal mid-run)
    --workers N         DataLoader worker processes per rank (default 0)
    --bug generator     input noise from a torch.Generator not passed to Run (a resume bug)
    --pids FILE         each rank appends "RANK PID" to FILE at start (to find orphans by pid)

Option names avoid prefixes of torchrun's own options: torchrun stops parsing at the script
path, but a reader of the command line should not have to know that.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import unbroken


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", default=os.environ.get("UNBROKEN_RUN_DIR"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--preempt-after", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--bug", choices=["none", "generator"], default="none")
    p.add_argument("--pids", default=None)
    p.add_argument("--snapshot-every", type=int, default=None)
    a = p.parse_args()

    rank, world = unbroken.init_distributed()
    if a.pids:
        with open(a.pids, "a") as f:
            f.write(f"{rank} {os.getpid()}\n")
    unbroken.seed_everything(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(96, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x @ torch.randn(8, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    noise = torch.Generator().manual_seed(7 + rank)
    loader = unbroken.MapLoader(
        data, batch_size=12, shuffle=True, seed=3, num_workers=a.workers, drop_last=True
    )
    comps: dict[str, object] = {"model": net, "optimizer": opt, "loader": loader}
    if a.bug != "generator":
        comps["noise"] = noise
    run = unbroken.Run(
        a.run_dir,
        **comps,
        save_every=a.save_every,
        max_steps=a.steps,
        progress=False,
        snapshot_every=a.snapshot_every,
    )
    start = run.counters.step
    for xb, yb in run.loop(loader):
        xb = xb + 0.05 * torch.randn(xb.shape, generator=noise)
        loss = F.mse_loss(net(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if a.step_sleep:
            time.sleep(a.step_sleep)
        run.step(loss=loss)
        at = run.counters.step
        if a.preempt_after and rank == 0 and at == start + a.preempt_after and at + 1 < a.steps:
            os.kill(os.getpid(), signal.SIGTERM)
    if world > 1:
        dist.barrier()


if __name__ == "__main__":
    main()
