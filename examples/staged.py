"""Staged training, resumable bit for bit: the model grows and the settings follow schedules.

    python examples/staged.py --run-dir runs/staged [--steps N] [--save-every K]

* the model grows from 2 to 4 residual blocks at the start of epoch 2 (``on_epoch_start``), and
  its hidden width doubles at step 70 (``before_step``) -- Adam moments and EMA weights of grown
  parameters carry over into the leading slice, new entries start at zero (moments) or at the
  live weight (EMA);
* batch size 16 -> 32 -> 64 by step, gradient accumulation 1 -> 2 by epoch, warmup + cosine
  learning rate: all pure functions of (step, epoch);
* on resume the model is rebuilt for the saved stage by ``build_model(stage)`` before loading.

Same contract as char_lm.py: ``RUN/final.safetensors``, ``RUN/trace.jsonl`` (step, epoch, loss, lr,
batch_size, samples per optimizer step), exit 0 when complete and 75 when stopped by a signal.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import unbroken

FEATURES, CLASSES = 16, 10


class Teacher(torch.utils.data.Dataset):
    """A fixed random teacher labels noisy inputs; the noise is per-sample augmentation."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(n, FEATURES, generator=g)
        w = torch.randn(FEATURES, CLASSES, generator=g)
        self.y = (torch.tanh(self.x @ w) + 0.3 * torch.randn(n, CLASSES, generator=g)).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def get_sample(self, i: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.05 * torch.randn(FEATURES, generator=generator), self.y[i]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model(stage: dict[str, int]) -> Net:
    """The model factory: the architecture of a stage (weights come from elsewhere)."""
    return Net(stage["layers"], stage["width"])


@torch.no_grad()
def grown(old: Net, stage: dict[str, int]) -> Net:
    """A bigger model computing (nearly) the same function: old weights in the leading slices,
    new blocks start as identities (their last layer is zero)."""
    new = build_model(stage)
    old_sd, new_sd = old.state_dict(), new.state_dict()
    for name, t in new_sd.items():
        if name.startswith("blocks.") and name not in old_sd and name.endswith("fc.weight"):
            t.zero_()
        if name in old_sd:
            src = old_sd[name]
            if name.endswith("weight") and t.dim() == 1:  # LayerNorm gain: 1 for new features
                t.fill_(1.0)
            elif t.shape != src.shape:
                t.zero_()
            t[tuple(slice(0, s) for s in src.shape)] = src
    new.load_state_dict(new_sd)
    return new


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--remote", metavar="URL", help="also keep checkpoints in s3://bucket/prefix")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--grow-epoch", type=int, default=2)
    p.add_argument("--widen-step", type=int, default=70)
    p.add_argument("--workers", type=int, default=0)
    a = p.parse_args()

    unbroken.seed_everything(0)
    stage0 = {"layers": 2, "width": 32}
    model = build_model(stage0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ema = unbroken.EMA(model, decay=0.95)
    data = Teacher(a.samples)
    loader = unbroken.MapLoader(data, batch_size=16, seed=0, num_workers=a.workers)

    def on_epoch_start(ctx: Any) -> Any:
        if ctx.epoch == a.grow_epoch and ctx.stage["layers"] == 2:
            stage = {**ctx.stage, "layers": 4}
            return unbroken.train.Change(model=grown(ctx.model, stage), stage=stage)
        return None

    def before_step(ctx: Any) -> Any:
        if ctx.step == a.widen_step and ctx.stage["width"] == 32:
            stage = {**ctx.stage, "width": 64}
            return unbroken.train.Change(model=grown(ctx.model, stage), stage=stage)
        return None

    settings = unbroken.train.Settings(
        lr=unbroken.train.WarmupCosine(
            peak=3e-3, total=a.steps, warmup=min(10, a.steps // 4), final=1e-4
        ),
        batch_size=unbroken.train.StepTable({0: 16, 40: 32, 80: 64}),
        grad_accum=unbroken.train.EpochTable({0: 1, 3: 2}),
        clip=1.0,
    )
    run = unbroken.Run(
        a.run_dir,
        model=model,
        optimizer=opt,
        ema=ema,
        loader=loader,
        settings=settings,
        on_epoch_start=on_epoch_start,
        before_step=before_step,
        model_factory=build_model,
        stage=stage0,
        save_every=a.save_every,
        remote=a.remote,  # unbroken: an object store tier (docs/remote.md)
        max_steps=a.steps,
    )
    samples: list[int] = []
    total = 0.0
    for x, y in run.loop(loader):
        model = run.model  # the current stage's model (a callback may have replaced it)
        loss = F.cross_entropy(model(x), y) / run.settings.grad_accum
        loss.backward()
        samples.extend(loader.last_indices)
        total += loss.item()
        if run.accumulating:
            continue
        nn.utils.clip_grad_norm_(model.parameters(), run.settings.clip)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.ema.update()
        run.step(
            loss=total,
            lr=run.settings.lr,
            batch_size=len(samples),
            samples=list(samples),
            stage=run.stage,
        )
        samples.clear()
        total = 0.0

    final = os.path.join(a.run_dir, "final.safetensors")
    unbroken.export_weights(final, model=run.model, ema=run.ema)
    unbroken.train.write_trace(a.run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
