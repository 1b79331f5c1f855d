"""examples/lightning_lm.py's LightningModule and unbroken callback under DDP: W processes
started with torchrun's environment (tests/dist_launch.py), ``Trainer(accelerator="cpu",
devices=W, strategy="ddp")`` over gloo.

    python tests/scripts/lightning_ddp.py --run-dir D [--steps N] [--save-every K] [--accum A]
        [--term-rank R --term-at K]

The change to the example: the ``unbroken.MapLoader`` is built in ``train_dataloader()``,
after Lightning initialised the process group, so each rank takes its slice of every global
batch (built before ``fit``, it would be a one-process loader on every rank).
``--term-rank R --term-at K``: rank R alone sends itself SIGTERM as step K + 1 starts.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
from pathlib import Path

import pytorch_lightning as pl
import torch

import unbroken
from unbroken.integrations import LightningCallback

EXAMPLE = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "lightning_lm.py"))


class DDPCharLM(EXAMPLE["LitCharLM"]):  # type: ignore[misc, valid-type]
    def __init__(self, data: object, batch_size: int, workers: int, **kw: object) -> None:
        super().__init__(**kw)
        self.data, self.batch_size, self.workers = data, batch_size, workers
        self.term: tuple[int, int] | None = None  # (rank, step): see on_train_batch_start

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        # SIGTERM to this process alone, on one rank, as step K + 1 starts (its first
        # micro-batch): one rank signalled, as when a single node is preempted.
        if self.term == (self.trainer.global_rank, self.trainer.global_step):
            os.kill(os.getpid(), signal.SIGTERM)

    def train_dataloader(self) -> unbroken.MapLoader:
        return unbroken.MapLoader(
            self.data, batch_size=self.batch_size, shuffle=True, seed=0, num_workers=self.workers
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=24, help="global: all ranks together")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epoch-samples", type=int, default=96)
    p.add_argument("--term-rank", type=int, default=None, help="SIGTERM this rank alone ...")
    p.add_argument("--term-at", type=int, default=None, help="... as step K + 1 starts")
    a = p.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    text = EXAMPLE["CORPUS"].read_text(encoding="utf-8")
    data = EXAMPLE["Crops"](text, 32, stride=16)
    data.n = min(data.n, a.epoch_samples)
    kw = {"vocab": len(data.chars), "context": 32, "dim": a.dim, "steps": a.steps, "lr": 3e-3}
    model = DDPCharLM(data, a.batch_size, a.workers, **kw)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy="ddp",
        max_steps=a.steps,
        accumulate_grad_batches=a.accum,
        gradient_clip_val=1.0,
        default_root_dir=a.run_dir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LightningCallback(a.run_dir, save_every=a.save_every)],
    )
    if a.term_rank is not None:
        model.term = (a.term_rank, a.term_at)
    trainer.fit(model)


if __name__ == "__main__":
    main()
