"""The seeded-bug library: one tiny training script, one deliberate resume bug per ``--bug``.

Each bug is a way a real script loses exactness on resume; tests/e2e/test_seeded_bugs.py checks
that unbroken catches every one -- at start-up where it can see it, else through
``verify_resume`` naming the component that diverges and the right hint first. ``--bug none``
tracks everything and resumes exactly.

    scheduler      an LR scheduler not passed to Run
    scaler         a GradScaler not passed to Run (its scale overflows, so steps get skipped)
    ema            an unbroken.EMA not passed to Run (its loss is logged)
    parameter      a CLIP-style logit_scale parameter that no tracked module owns
    module         a head module trained by the optimizer but not passed to Run
    generator      input noise from a torch.Generator not passed to Run
    numpy          input noise from a numpy RandomState not passed to Run
    pyrandom       input scaling from a random.Random not passed to Run
    loader-loop    a plain torch DataLoader given to run.loop()
    loader-epochs  a plain torch DataLoader iterated inside run.epochs()
    draw           fixed evaluation inputs drawn from the torch global RNG after Run()
    callback       a before_step callback that counts its calls in a closure
    buffer         a module whose running mean is a tensor attribute, not a buffer
    collate        a collator masking at random from the global torch stream, run for the next
                   step's batch before run.step() saves (the Trainer fetches ahead so): a
                   resume makes that draw again, from the restored stream
    reduce         in a resumed process, its first step adds the per-sample gradients in
                   another order (as DDP's first step after a launch reduces in its initial
                   bucket layout): the loss agrees, the update does not
    volatile       not a bug: a tracked TrainerState-like component logs wall-clock fields
                   (log_history entries with train_runtime, ..._per_second); verify passes
                   and lists them as not compared

The run directory is ``$UNBROKEN_RUN_DIR``. 24 samples in batches of 4: 6 steps are one epoch,
saved every 2 steps, so a resume lands mid-epoch.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np
import torch
import torch.nn.functional as F

import unbroken

BUGS = (
    "none",
    "scheduler",
    "scaler",
    "ema",
    "parameter",
    "module",
    "generator",
    "numpy",
    "pyrandom",
    "loader-loop",
    "loader-epochs",
    "draw",
    "callback",
    "buffer",
    "collate",
    "reduce",
    "volatile",
)


class Center(torch.nn.Module):
    """Subtracts a running mean of its input: a buffer, or (the bug) a plain attribute."""

    def __init__(self, hidden: bool) -> None:
        super().__init__()
        self.hidden = hidden
        if hidden:
            self.mean = torch.zeros(4)
        else:
            self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = 0.5 * self.mean + 0.5 * x.detach().mean(0)
        if self.hidden:
            self.mean = new
        else:
            self.mean.copy_(new)
        return x - self.mean


class History:
    """A TrainerState-like log history: each step's loss with the wall-clock fields the
    Hugging Face Trainer logs (``train_runtime``, ``train_samples_per_second``)."""

    def __init__(self) -> None:
        self.log_history: list[dict[str, float]] = []
        self.start = time.perf_counter()

    def log(self, step: int, loss: float) -> None:
        runtime = round(time.perf_counter() - self.start, 6) + 1e-6
        entry = {"step": step, "loss": loss, "train_runtime": runtime}
        self.log_history.append({**entry, "train_samples_per_second": 4 * step / runtime})

    def state_dict(self) -> dict[str, object]:
        return {"log_history": [dict(e) for e in self.log_history]}

    def load_state_dict(self, state_dict: dict[str, list[dict[str, float]]]) -> None:
        self.log_history = [dict(e) for e in state_dict["log_history"]]


def mask(shape: torch.Size) -> torch.Tensor:
    """A collator's random masking (DataCollatorForLanguageModeling's draw), from the global
    torch stream."""
    return (torch.rand(shape) > 0.25).float()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bug", choices=BUGS, default="none")
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    bug = a.bug

    unbroken.seed_everything(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    model = torch.nn.Sequential(
        Center(bug == "buffer"), torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    head = torch.nn.Linear(1, 1)
    scale = torch.nn.ParameterDict({"logit": torch.nn.Parameter(torch.zeros([]))})
    params = [*model.parameters(), *head.parameters()]
    params += [scale["logit"]] if bug == "parameter" else [*scale.parameters()]
    opt = torch.optim.AdamW(params, lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)
    # The loss is scaled by 1e30 * scale (undone after unscale_), so that a scale
    # above ~2**27 overflows: the scaler then skips the step and backs off.
    # (Off for "reduce": whether a sum overflows depends on its order too, and that bug is
    # about the order alone.)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**26, growth_interval=1, enabled=bug != "reduce"
    )
    ema = unbroken.EMA(model, decay=0.5)
    noise = torch.Generator().manual_seed(1)
    np_rs = np.random.RandomState(2)
    py_rng = random.Random(3)
    comps: dict[str, object] = {
        "model": model,
        "head": head,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "ema": ema,
        "noise": noise,
        "np_rs": np_rs,
        "py_rng": py_rng,
    }
    if bug != "parameter":
        comps["scale"] = scale
    history = History()
    if bug == "volatile":
        comps["trainer_state"] = history
    untracked = {
        "scheduler": "scheduler",
        "scaler": "scaler",
        "ema": "ema",
        "module": "head",
        "generator": "noise",
        "numpy": "np_rs",
        "pyrandom": "py_rng",
    }
    comps.pop(untracked.get(bug, ""), None)
    if bug.startswith("loader-"):
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    else:
        loader = unbroken.MapLoader(data, batch_size=4, shuffle=True, seed=0)
        comps["loader"] = loader
    calls = 0

    def before_step(ctx: unbroken.StepContext) -> dict[str, float]:
        nonlocal calls
        calls += 1
        n = calls if bug == "callback" else ctx.step + 1  # the bug: state the resume resets
        return {"clip": 1.0 / n}

    run = unbroken.Run(
        os.environ["UNBROKEN_RUN_DIR"],
        **comps,
        # run.epochs() takes no settings or before_step (they act at step starts, in run.loop())
        settings=None if bug == "loader-epochs" else unbroken.train.Settings(clip=1.0),
        before_step=None if bug == "loader-epochs" else before_step,
        save_every=2,
        max_steps=a.steps,
        progress=False,
    )
    eval_x = torch.randn(4, 4) if bug == "draw" else torch.ones(4, 4)  # the bug: after Run()

    if bug == "loader-epochs":

        def batches():
            for _ in run.epochs(10**6):
                for batch in loader:
                    yield batch
                    if run.done:
                        break

        source = batches()
    else:
        source = run.loop(loader)
    ahead: torch.Tensor | None = None  # bug "collate": masks drawn before the last save
    first = run.resumed_from is not None  # bug "reduce": the first step of a resumed process
    for x, y in source:
        if bug == "collate":
            # The fetch ahead: this step's masks were drawn during the previous step, before
            # run.step() saved the streams; a resumed process draws them again, from there.
            x = x * (ahead if ahead is not None else mask(x.shape))
        x = x + 0.1 * torch.randn(x.shape, generator=noise)
        x = x + 0.1 * torch.from_numpy(np_rs.standard_normal(x.shape).astype(np.float32))
        x = x * (1.0 + 0.1 * py_rng.random())
        out = head(model(x)) * scale["logit"].exp()
        loss = F.mse_loss(out, y)
        opt.zero_grad()
        if bug == "reduce":
            per_sample = F.mse_loss(out, y, reduction="none").mean(1) / len(y)
            order = range(len(y) - 1, -1, -1) if first else range(len(y))
            for i in order:  # p.grad accumulates in this order
                scaler.scale(per_sample[i] * 1e30).backward(retain_graph=True)
            first = False
        else:
            scaler.scale(loss * 1e30).backward()
        scaler.unscale_(opt)  # records whether any gradient overflowed
        for p in params:
            if p.grad is not None:
                p.grad.mul_(1e-30)
        clip = run.settings.get("clip", 1.0)
        torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(opt)
        scaler.update()
        sched.step()
        ema.update()
        with torch.no_grad(), ema.applied():
            ema_loss = F.mse_loss(head(model[1:](eval_x)), torch.zeros(4, 1)).item()
        if bug == "collate":
            ahead = mask(x.shape)  # the next batch's masks, drawn before the save below
        history.log(run.counters.step + 1, loss.item())
        run.step(loss=loss.item(), ema_loss=ema_loss, scale=scaler.get_scale())


if __name__ == "__main__":
    main()
