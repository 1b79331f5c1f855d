"""The unified ``lightning`` package (``import lightning as L``; ``lightning.pytorch``): a
LightningDataModule whose loaders are unbroken.MapLoaders, a validation loop every few steps,
and a per-step field of the metrics log returned by ``training_step``. The examples' contract:
--run-dir, --steps, --save-every, automatic resume, RUN/final.safetensors, RUN/trace.jsonl,
exit 75 when stopped."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

import unbroken
from unbroken.integrations import LightningCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from char_lm import CORPUS, CharLM, Crops  # noqa: E402


class Chars(L.LightningDataModule):
    def __init__(self, context: int, batch_size: int, workers: int, samples: int) -> None:
        super().__init__()
        self.context, self.batch_size, self.workers, self.samples = (
            context,
            batch_size,
            workers,
            samples,
        )

    def setup(self, stage: str) -> None:
        text = CORPUS.read_text(encoding="utf-8")
        self.train, self.val = Crops(text[:20000], self.context, self.context // 2), None
        self.train.n = min(self.train.n, self.samples)
        self.val = Crops(text[20000:24000], self.context, self.context)
        self.val.n = min(self.val.n, 8)

    def train_dataloader(self):
        return unbroken.MapLoader(
            self.train, batch_size=self.batch_size, shuffle=True, seed=0, num_workers=self.workers
        )

    def val_dataloader(self):
        return unbroken.MapLoader(self.val, batch_size=4, seed=0)


class Lit(L.LightningModule):
    def __init__(self, vocab: int, context: int) -> None:
        super().__init__()
        self.net = CharLM(vocab, context, dim=32, layers=1, heads=2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        hits = (logits.argmax(-1) == y).float().mean()
        return {"loss": loss, "accuracy": hits}  # every other scalar: a field of the step's log

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x).flatten(0, 1), y.flatten()))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    dm = Chars(context=16, batch_size=8, workers=a.workers, samples=40)
    dm.setup("fit")
    model = Lit(len(dm.train.chars), 16)
    resume = LightningCallback(a.run_dir, save_every=a.save_every)
    trainer = L.Trainer(
        max_steps=a.steps,
        val_check_interval=4,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        callbacks=[resume],
    )
    trainer.fit(model, datamodule=dm)
    assert resume.run is not None and resume.run.counters.step == a.steps  # the Run, reached
    unbroken.export_weights(os.path.join(a.run_dir, "final.safetensors"), model=model.net)
    unbroken.train.write_trace(a.run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
