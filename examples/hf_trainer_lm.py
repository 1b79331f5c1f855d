"""A tiny randomly initialised GPT-2 (built from a ``GPT2Config``, no download) trained as a
character-level LM by the Hugging Face ``transformers`` Trainer, resumable bit for bit.

    python examples/hf_trainer_lm.py --run-dir runs/hf_trainer_lm [--steps N] [--save-every K]

An ordinary ``Trainer`` script: ``TrainingArguments`` with warmup, gradient accumulation,
``dataloader_num_workers=2`` and ``max_steps``. Stop it any way you like (Ctrl-C, ``kill``,
``kill -9``, a cluster's preemption) and run the same command again: it continues from the last
checkpoint and ends exactly where an uninterrupted run ends. On completion it writes
``RUN/final.safetensors`` (the model's weights) and ``RUN/trace.jsonl`` (one line per optimizer
step: step, epoch, loss, lr). It exits 0 when complete and 75 when stopped by a signal after
saving (relaunch to continue).

The lines unbroken adds to a plain Trainer script are marked ``# unbroken``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

import unbroken  # unbroken (for export_weights/write_trace below)
from unbroken.integrations import TransformersTrainer  # unbroken

sys.path.insert(0, str(Path(__file__).parent))
from char_lm import CORPUS, Crops  # noqa: E402 - the data of char_lm.py


class CharWindows(torch.utils.data.Dataset):
    """char_lm.py's randomly cropped windows as the dicts a transformers model takes."""

    def __init__(self, crops: Crops) -> None:
        self.crops = crops

    def __len__(self) -> int:
        return len(self.crops)

    def get_sample(self, i: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        x, _ = self.crops.get_sample(i, generator)  # the crop offset: seeded per sample
        return {"input_ids": x, "labels": x}  # the model shifts the labels itself

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # evaluation: a fixed crop
        return self.get_sample(i, torch.Generator().manual_seed(i))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=8, help="per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch-samples", type=int, default=None, help="use only the first N windows")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument(
        "--persistent-workers", action="store_true", help="keep the loaders' workers between passes"
    )
    a = p.parse_args()

    torch.set_num_threads(1)
    set_seed(a.seed)  # the model's initial weights must be seeded
    data = Crops(CORPUS.read_text(encoding="utf-8"), a.context, stride=a.context // 2)
    if a.epoch_samples is not None:
        data.n = min(data.n, a.epoch_samples)
    config = GPT2Config(
        vocab_size=len(data.chars), n_positions=a.context, n_embd=a.dim, n_layer=1, n_head=2
    )
    model = GPT2LMHeadModel(config)  # dropout 0.1 (GPT-2's default) in every block
    args = TrainingArguments(
        output_dir=a.run_dir,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.accum,
        learning_rate=a.lr,
        weight_decay=0.1,
        warmup_steps=max(1, a.steps // 10),
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        dataloader_num_workers=a.workers,
        dataloader_persistent_workers=a.persistent_workers and a.workers > 0,
        save_strategy="steps",
        save_steps=a.save_every,
        logging_steps=1,
        eval_strategy="steps" if a.eval_every else "no",
        eval_steps=a.eval_every or None,
        per_device_eval_batch_size=a.batch_size,
        seed=a.seed,
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    held_out = Crops(CORPUS.read_text(encoding="utf-8"), a.context, stride=a.context // 2)
    held_out.n = min(held_out.n, 16)
    trainer = TransformersTrainer(  # unbroken: was transformers.Trainer
        model=model,
        args=args,
        train_dataset=CharWindows(data),
        eval_dataset=CharWindows(held_out) if a.eval_every else None,
    )
    trainer.train()  # unbroken: resumes by itself (no resume_from_checkpoint)

    # GPT-2 ties lm_head to the token embedding; safetensors wants one copy of each tensor.
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    unbroken.export_weights(os.path.join(a.run_dir, "final.safetensors"), model=weights)
    trace = unbroken.train.write_trace(a.run_dir)  # RUN/trace.jsonl: step, epoch, loss, lr
    print(
        f"done: {trainer.state.global_step} steps, final loss {trace[-1]['loss']:.4f}", flush=True
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
