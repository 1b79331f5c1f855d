"""A tiny training loop with one deliberate resume bug, for tests/e2e/test_verify.py.

    --bug none        everything tracked: resumes exactly
    --bug generator   input noise from a torch.Generator that is not passed to Run
    --bug scheduler   an LR scheduler that is not passed to Run
    --bug loader      a plain torch DataLoader (shuffle=True): not resumable; iterated inside
                      run.epochs(), where Run cannot see it (run.loop() refuses it at once)
    --bug dropout     dropout masks from a torch.Generator that is not passed to Run
    --bug shuffle     the dataset shuffles itself with an unseeded NumPy generator, ignoring the
                      loader's seed: no two launches see the same data, interrupted or not

The run directory is ``--run-dir`` or, if not given, ``$UNBROKEN_RUN_DIR``. 40 samples in
batches of 8 make 5 steps an epoch, so no checkpoint (every 4 steps) falls on an epoch boundary,
where a plain DataLoader would happen to resume exactly.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F

import unbroken

BUGS = ("none", "generator", "scheduler", "loader", "dropout", "shuffle")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", default=os.environ.get("UNBROKEN_RUN_DIR"))
    p.add_argument("--bug", choices=BUGS, default="none")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=4)
    a = p.parse_args()

    unbroken.seed_everything(0)
    x, y = torch.randn(40, 4), torch.randn(40, 1)
    if a.bug == "shuffle":
        order = torch.from_numpy(np.random.default_rng().permutation(40))  # seeded by the OS
        x, y = x[order], y[order]
    data = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
    noise = torch.Generator().manual_seed(1)  # augmentation noise
    drop = torch.Generator().manual_seed(2)  # dropout masks
    comps: dict[str, object] = {"model": model, "optimizer": opt}
    if a.bug != "scheduler":
        comps["scheduler"] = sched
    if a.bug != "generator":
        comps["noise"] = noise
    if a.bug != "dropout":
        comps["drop"] = drop
    if a.bug == "loader":
        loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    else:
        loader = unbroken.MapLoader(data, batch_size=8, shuffle=True, seed=0)
        comps["loader"] = loader
    run = unbroken.Run(
        a.run_dir, **comps, save_every=a.save_every, max_steps=a.steps, progress=False
    )
    for x, y in _batches(run, loader, a.bug == "loader"):
        x = x + 0.1 * torch.randn(x.shape, generator=noise)
        h = model[1](model[0](x))
        mask = (torch.rand(h.shape, generator=drop) > 0.25).float() / 0.75
        loss = F.mse_loss(model[2](h * mask), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        run.step(loss=loss.item(), lr=sched.get_last_lr()[0])


def _batches(run: unbroken.Run, loader: object, hidden: bool):
    if not hidden:
        yield from run.loop(loader)
        return
    for _epoch in run.epochs(10**6):
        for batch in loader:  # type: ignore[attr-defined]
            yield batch
            if run.done:
                break


if __name__ == "__main__":
    main()
