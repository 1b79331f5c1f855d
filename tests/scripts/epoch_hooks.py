"""on_epoch_start under gradient accumulation, for tests/e2e/test_epoch_start.py (issue 17).

10 samples in batches of 3 make 4 batches an epoch (3, 3, 3, 1), so with ``--accum`` 2 or 3
many steps' micro-batches span an epoch boundary. Every step logs the epochs whose
on_epoch_start ran during it, the epoch of each of its micro-batches, and the loss.
``--signal-at K --signal TERM|KILL``: the first launch signals itself after step K.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F

import unbroken


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal", choices=["TERM", "KILL"], default="TERM")
    a = p.parse_args()

    unbroken.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.randn(10, 1))
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = unbroken.MapLoader(data, batch_size=3, shuffle=True, seed=0)
    started: list[int] = []
    run = unbroken.Run(
        a.run_dir,
        model=model,
        optimizer=opt,
        loader=loader,
        settings=unbroken.train.Settings(grad_accum=a.accum),
        on_epoch_start=lambda ctx: started.append(ctx.epoch),
        save_every=2,
        max_steps=a.steps,
        progress=False,
    )
    first_launch = run.resumed_from is None
    epochs: list[int] = []
    for x, y in run.loop(loader):
        epochs.append(loader.epoch)
        loss = F.mse_loss(model(x), y) / a.accum
        loss.backward()
        if run.accumulating:
            continue
        opt.step()
        opt.zero_grad()
        run.step(loss=loss.item(), epoch_starts=list(started), batch_epochs=list(epochs))
        started.clear()
        epochs.clear()
        if first_launch and run.counters.step == a.signal_at:
            os.kill(os.getpid(), getattr(signal, "SIG" + a.signal))


if __name__ == "__main__":
    main()
