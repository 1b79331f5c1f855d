"""examples/hf_trainer_lm.py's GPT-2 and data under DDP: W processes started with torchrun's
environment (tests/dist_launch.py); ``TrainingArguments(use_cpu=True)`` then trains with DDP
over gloo (accelerate's MULTI_CPU).

    python tests/scripts/hf_ddp.py --run-dir D [--steps N] [--save-every K]
        [--find-unused-parameters true|false]

``--find-unused-parameters`` is ``TrainingArguments(ddp_find_unused_parameters=...)``; left
out, the Trainer's default, which is True for a ``PreTrainedModel`` without activation
checkpointing: DDP then never rebuilds its buckets. With false (what a model with activation
checkpointing gets, and what speed-minded scripts set) DDP rebuilds them after the first
backward, the case unbroken's fixed reduction layout exists for (train/_reduction.py).
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

from unbroken.integrations import TransformersTrainer

EXAMPLE = runpy.run_path(str(Path(__file__).parents[2] / "examples" / "hf_trainer_lm.py"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="per device (rank) and micro-batch")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epoch-samples", type=int, default=96)
    p.add_argument("--find-unused-parameters", choices=["true", "false"], default=None)
    a = p.parse_args()

    torch.set_num_threads(1)
    set_seed(0)
    data = EXAMPLE["Crops"](EXAMPLE["CORPUS"].read_text(encoding="utf-8"), 32, stride=16)
    data.n = min(data.n, a.epoch_samples)
    config = GPT2Config(
        vocab_size=len(data.chars), n_positions=32, n_embd=a.dim, n_layer=1, n_head=2
    )
    args = TrainingArguments(
        output_dir=a.run_dir,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.accum,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=max(1, a.steps // 10),
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        dataloader_num_workers=a.workers,
        save_strategy="steps",
        save_steps=a.save_every,
        logging_steps=1,
        seed=0,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=(
            None if a.find_unused_parameters is None else a.find_unused_parameters == "true"
        ),
    )
    trainer = TransformersTrainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=EXAMPLE["CharWindows"](data)
    )
    trainer.train()


if __name__ == "__main__":
    main()
