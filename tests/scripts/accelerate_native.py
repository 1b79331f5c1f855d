"""examples/accelerate_lm.py's model and data with Accelerate's own documented resume.

    python tests/scripts/accelerate_native.py --run-dir D --steps N --save-every K [--kill-at S]

A torch DataLoader (2 workers, shuffled) through ``accelerator.prepare``; every K optimizer
steps ``accelerator.save_state(D/state)``; on relaunch ``accelerator.load_state`` and
``accelerator.skip_first_batches`` for the epoch in progress. ``--kill-at S`` SIGKILLs the
process after optimizer step S. Writes ``D/final.safetensors``. The test shows that this resume
does not continue bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import save_file

EXAMPLE = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "char_lm.py"))


class GlobalRNGCrops(torch.utils.data.Dataset):
    """The example's windows through __getitem__, the crop offset from the global stream."""

    def __init__(self, crops) -> None:
        self.crops = crops

    def __len__(self) -> int:
        return len(self.crops)

    def __getitem__(self, i: int):
        return self.crops.get_sample(i, torch.default_generator)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--epoch-samples", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=None)
    a = p.parse_args()

    torch.set_num_threads(1)
    accelerator = Accelerator(gradient_accumulation_steps=a.accum)
    set_seed(0)
    data = EXAMPLE["Crops"](EXAMPLE["CORPUS"].read_text(encoding="utf-8"), 32, stride=16)
    data.n = min(data.n, a.epoch_samples)
    loader = torch.utils.data.DataLoader(
        GlobalRNGCrops(data), batch_size=8, shuffle=True, num_workers=2
    )
    model = EXAMPLE["CharLM"](len(data.chars), 32, dim=32, layers=1, heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    lr_at = EXAMPLE["lr_at"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, a.steps, 3e-3, max(1, a.steps // 10)) / 3e-3
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state_dir = os.path.join(a.run_dir, "state")
    step = 0
    if os.path.exists(os.path.join(state_dir, "progress.json")):
        accelerator.load_state(state_dir)
        with open(os.path.join(state_dir, "progress.json")) as f:
            step = json.load(f)["step"]
    micro = step * a.accum
    epoch, skip = divmod(micro, len(loader))
    model.train()
    while step < a.steps:
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % a.save_every == 0:
                accelerator.save_state(state_dir)
                with open(os.path.join(state_dir, "progress.json"), "w") as f:
                    json.dump({"step": step}, f)
            if step == a.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= a.steps:
                break
        epoch += 1
    weights = {k: v.contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    save_file(weights, os.path.join(a.run_dir, "final.safetensors"))


if __name__ == "__main__":
    main()
