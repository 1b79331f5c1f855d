"""examples/lightning_lm.py's model and data with Lightning's own documented resume, no unbroken.

    python tests/scripts/lightning_native.py --run-dir D --steps N --save-every K [--kill-at S]

A torch DataLoader (2 workers, shuffled), ``ModelCheckpoint(every_n_train_steps=K,
save_last=True)`` and ``trainer.fit(..., ckpt_path="last")`` when a checkpoint exists.
``--kill-at S`` SIGKILLs the process after optimizer step S. Writes ``D/final.safetensors``.
The test shows that this resume does not continue bit for bit.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
from pathlib import Path

import pytorch_lightning as pl
import torch
from safetensors.torch import save_file

EXAMPLE = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "lightning_lm.py"))


class GlobalRNGCrops(torch.utils.data.Dataset):
    """The example's windows through __getitem__, the crop offset drawn from the global stream
    (which torch's DataLoader seeds per worker), as a plain Lightning script would do."""

    def __init__(self, crops) -> None:
        self.crops = crops

    def __len__(self) -> int:
        return len(self.crops)

    def __getitem__(self, i: int):
        return self.crops.get_sample(i, torch.default_generator)


class KillAt(pl.Callback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--epoch-samples", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=None)
    a = p.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data = EXAMPLE["Crops"](EXAMPLE["CORPUS"].read_text(encoding="utf-8"), 32, stride=16)
    data.n = min(data.n, a.epoch_samples)
    loader = torch.utils.data.DataLoader(
        GlobalRNGCrops(data), batch_size=16, shuffle=True, num_workers=2
    )
    model = EXAMPLE["LitCharLM"](len(data.chars), 32, 32, a.steps, 3e-3)
    ckpt_dir = os.path.join(a.run_dir, "lightning")
    trainer = pl.Trainer(
        max_steps=a.steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=ckpt_dir, every_n_train_steps=a.save_every, save_last=True, save_top_k=-1
            ),
            KillAt(a.kill_at),
        ],
    )
    last = os.path.join(ckpt_dir, "last.ckpt")
    trainer.fit(model, train_dataloaders=loader, ckpt_path=last if os.path.exists(last) else None)
    weights = {k: v.contiguous() for k, v in model.net.state_dict().items()}
    save_file(weights, os.path.join(a.run_dir, "final.safetensors"))


if __name__ == "__main__":
    main()
