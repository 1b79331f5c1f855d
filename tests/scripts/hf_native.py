"""examples/hf_trainer_lm.py's model and data with the Trainer's own documented resume, no unbroken.

    python tests/scripts/hf_native.py --run-dir D --steps N --save-every K [--kill-at S]

A plain ``transformers.Trainer`` (its own shuffled torch DataLoader, 2 workers), checkpoints
every K steps (``save_steps``) and ``trainer.train(resume_from_checkpoint=...)`` from the last
one when it exists. ``--kill-at S`` SIGKILLs the process after optimizer step S. Writes
``D/final.safetensors``. The test shows that this resume does not continue bit for bit.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

EXAMPLE = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "char_lm.py"))


class GlobalRNGWindows(torch.utils.data.Dataset):
    """The example's windows through __getitem__, the crop offset drawn from the global stream
    (which torch's DataLoader seeds per worker), as a plain Trainer script would do."""

    def __init__(self, crops) -> None:
        self.crops = crops

    def __len__(self) -> int:
        return len(self.crops)

    def __getitem__(self, i: int):
        x, _ = self.crops.get_sample(i, torch.default_generator)
        return {"input_ids": x, "labels": x}


class KillAt(TrainerCallback):
    """SIGKILL once step S is over (after the Trainer's checkpoint of S, if it writes one)."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--epoch-samples", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=None)
    a = p.parse_args()

    torch.set_num_threads(1)
    set_seed(0)
    data = EXAMPLE["Crops"](EXAMPLE["CORPUS"].read_text(encoding="utf-8"), 32, stride=16)
    data.n = min(data.n, a.epoch_samples)
    config = GPT2Config(vocab_size=len(data.chars), n_positions=32, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    ckpt_dir = os.path.join(a.run_dir, "trainer")
    args = TrainingArguments(
        output_dir=ckpt_dir,
        max_steps=a.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=max(1, a.steps // 10),
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        dataloader_num_workers=2,
        save_strategy="steps",
        save_steps=a.save_every,
        logging_steps=1,
        seed=0,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=GlobalRNGWindows(data), callbacks=[KillAt(a.kill_at)]
    )
    last = get_last_checkpoint(ckpt_dir) if os.path.isdir(ckpt_dir) else None
    trainer.train(resume_from_checkpoint=last)
    weights = {k: v.clone().contiguous() for k, v in trainer.model.state_dict().items()}
    save_file(weights, os.path.join(a.run_dir, "final.safetensors"))


if __name__ == "__main__":
    main()
