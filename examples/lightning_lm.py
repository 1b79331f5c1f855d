"""char_lm.py's character-level transformer, trained by PyTorch Lightning, resumable bit for bit.

    python examples/lightning_lm.py --run-dir runs/lightning_lm [--steps N] [--save-every K]

An ordinary LightningModule and ``Trainer(max_steps=...)``. Stop it any way you like (Ctrl-C,
``kill``, ``kill -9``, a cluster's preemption) and run the same command again: it continues from
the last checkpoint and ends exactly where an uninterrupted run ends. On completion it writes
``RUN/final.safetensors`` (the model's weights) and ``RUN/trace.jsonl`` (one line per optimizer
step: step, epoch, loss, lr). It exits 0 when complete and 75 when stopped by a signal after
saving (relaunch to continue).

The lines unbroken adds to a plain Lightning script are marked ``# unbroken``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

import unbroken  # unbroken
from unbroken.integrations import LightningCallback  # unbroken

sys.path.insert(0, str(Path(__file__).parent))
from char_lm import CORPUS, CharLM, Crops, lr_at  # noqa: E402 - the model and data of char_lm.py


class LitCharLM(pl.LightningModule):
    def __init__(self, vocab: int, context: int, dim: int, steps: int, lr: float) -> None:
        super().__init__()
        self.net = CharLM(vocab, context, dim=dim, layers=1, heads=2)
        self.steps, self.lr = steps, lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        warmup = max(1, self.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_at(s, self.steps, self.lr, warmup) / self.lr
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--accum", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch-samples", type=int, default=None, help="use only the first N windows")
    a = p.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(a.seed, verbose=False)  # the model's initial weights must be seeded
    data = Crops(CORPUS.read_text(encoding="utf-8"), a.context, stride=a.context // 2)
    if a.epoch_samples is not None:
        data.n = min(data.n, a.epoch_samples)
    loader = unbroken.MapLoader(  # unbroken: instead of torch.utils.data.DataLoader
        data, batch_size=a.batch_size, shuffle=True, seed=a.seed, num_workers=a.workers
    )
    model = LitCharLM(len(data.chars), a.context, a.dim, a.steps, a.lr)
    trainer = pl.Trainer(
        max_steps=a.steps,
        accumulate_grad_batches=a.accum,
        gradient_clip_val=1.0,
        default_root_dir=a.run_dir,  # (where a SLURM requeue puts Lightning's hpc_ckpt)
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LightningCallback(a.run_dir, save_every=a.save_every)],  # unbroken
    )
    trainer.fit(model, train_dataloaders=loader)

    unbroken.export_weights(os.path.join(a.run_dir, "final.safetensors"), model=model.net)
    trace = unbroken.train.write_trace(a.run_dir)  # RUN/trace.jsonl: step, epoch, loss, lr
    print(f"done: {trainer.global_step} steps, final loss {trace[-1]['loss']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
