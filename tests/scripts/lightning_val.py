"""lightning_lm.py with a validation loader: a plain torch DataLoader (2 workers, persistent or
not) that Lightning runs every ``--val-every`` steps, next to unbroken's train loader.

``ValLog`` is a stateful callback (so unbroken tracks it): it keeps every validation's
(global step, val_loss); a resumed run must hold each one exactly once, and the same values as
an uninterrupted run. Prints ``start N`` when training starts and ``done`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

import unbroken
from unbroken.integrations import LightningCallback

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from char_lm import CORPUS, CharLM, Crops  # noqa: E402


class Lit(pl.LightningModule):
    def __init__(self, vocab: int, context: int) -> None:
        super().__init__()
        self.net = CharLM(vocab, context, dim=16, layers=1, heads=2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x).flatten(0, 1), y.flatten()))

    def on_train_start(self) -> None:
        print(f"start {self.trainer.global_step}", flush=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class Windows(torch.utils.data.Dataset):
    """Evaluation: window i at a fixed offset (no randomness in the data)."""

    def __init__(self, crops: Crops) -> None:
        self.crops = crops

    def __len__(self) -> int:
        return len(self.crops)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.crops
        chunk = c.data[i * c.stride : i * c.stride + c.context + 1]
        return chunk[:-1], chunk[1:]


class ValLog(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            loss = float(trainer.callback_metrics["val_loss"])
            self.seen.append([trainer.global_step, loss])
            print(f"val {trainer.global_step}", flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": [list(s) for s in self.seen]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen = [list(s) for s in state_dict["seen"]]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--val-every", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--val-workers", type=int, default=2)
    p.add_argument("--val-persistent", action="store_true")
    p.add_argument("--epoch-samples", type=int, default=40)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--precision", default="32-true")
    a = p.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    text = CORPUS.read_text(encoding="utf-8")
    data = Crops(text, 16, stride=8)
    data.n = min(data.n, a.epoch_samples)
    held_out = Crops(text[-4000:], 16, stride=8)
    held_out.n = min(held_out.n, 24)
    loader = unbroken.MapLoader(data, batch_size=8, shuffle=True, seed=0, num_workers=a.workers)
    val_loader = torch.utils.data.DataLoader(
        Windows(held_out),
        batch_size=8,
        num_workers=a.val_workers,
        persistent_workers=a.val_persistent and a.val_workers > 0,
    )
    model = Lit(len(data.chars), 16)
    vals = ValLog()
    trainer = pl.Trainer(
        max_steps=a.steps,
        accumulate_grad_batches=a.accumulate,
        precision=a.precision,
        val_check_interval=a.val_every,
        check_val_every_n_epoch=None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        callbacks=[vals, LightningCallback(a.run_dir, save_every=a.save_every)],
    )
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=val_loader)
    with open(os.path.join(a.run_dir, "val.json"), "w") as f:
        json.dump(vals.seen, f)
    unbroken.export_weights(os.path.join(a.run_dir, "final.safetensors"), model=model.net)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
