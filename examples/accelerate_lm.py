"""The character-level transformer of char_lm.py, trained with Hugging Face Accelerate
(``accelerator.prepare``, gradient accumulation), resumable bit for bit.

    python examples/accelerate_lm.py --run-dir runs/accelerate_lm [--steps N] [--save-every K]
    accelerate launch examples/accelerate_lm.py --run-dir runs/accelerate_lm   # same contract

Stop it any way you like (Ctrl-C, ``kill``, ``kill -9``, a cluster's preemption) and run the same
command again: it continues from the last checkpoint and ends exactly where an uninterrupted run
ends. On completion it writes ``RUN/final.safetensors`` (the model's weights) and
``RUN/trace.jsonl`` (one line per optimizer step: step, epoch, loss, lr). It exits 0 when
complete and 75 when stopped by a signal after saving (relaunch to continue).

The lines unbroken adds to a plain Accelerate script are marked ``# unbroken``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

import unbroken  # unbroken
from unbroken.integrations import accelerate_run  # unbroken

sys.path.insert(0, str(Path(__file__).parent))
from char_lm import CORPUS, CharLM, Crops, lr_at  # noqa: E402 - the model and data of char_lm.py


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=8, help="per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch-samples", type=int, default=None, help="use only the first N windows")
    a = p.parse_args()

    torch.set_num_threads(1)
    accelerator = Accelerator(gradient_accumulation_steps=a.accum)
    set_seed(a.seed)  # the model's initial weights must be seeded
    data = Crops(CORPUS.read_text(encoding="utf-8"), a.context, stride=a.context // 2)
    if a.epoch_samples is not None:
        data.n = min(data.n, a.epoch_samples)
    loader = unbroken.MapLoader(  # unbroken: instead of torch.utils.data.DataLoader
        data, batch_size=a.batch_size, shuffle=True, seed=a.seed, num_workers=a.workers
    )
    model = CharLM(len(data.chars), a.context, dim=a.dim, layers=1, heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    warmup = max(1, a.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, a.steps, a.lr, warmup) / a.lr
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    run = accelerate_run(  # unbroken: resumes here if RUN has a checkpoint
        accelerator, a.run_dir, loader=loader, save_every=a.save_every, max_steps=a.steps
    )

    model.train()
    for x, y in run.loop(loader):  # unbroken: was `for epoch in ...: for x, y in loader:`
        with accelerator.accumulate(model):
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:  # unbroken: one optimizer step done
            run.step(loss=loss, lr=lr)  # unbroken: logs, saves, exits 75 on SIGTERM

    if accelerator.is_main_process:
        net = accelerator.unwrap_model(model)
        unbroken.export_weights(os.path.join(a.run_dir, "final.safetensors"), model=net)
        trace = unbroken.train.write_trace(a.run_dir)  # RUN/trace.jsonl: step, epoch, loss, lr
        print(f"done: {run.counters.step} steps, final loss {trace[-1]['loss']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
