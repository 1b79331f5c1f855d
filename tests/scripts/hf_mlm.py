"""A new user's masked-LM ``TransformersTrainer`` script: a collator that draws random numbers.

    python tests/scripts/hf_mlm.py --run-dir D [--steps N] [--save-every K] [--workers W]
        [--eval-every E] [--collator-seed N]

A tiny randomly initialised BERT (``BertConfig``, dropout 0.1, no download) trained on
variable-length token sequences with transformers' own ``DataCollatorForLanguageModeling``
(masking 25% of the tokens with ``torch.bernoulli``/``torch.randint`` from the global torch
stream, dynamic padding), after a random crop of every sequence drawn from Python's global
``random``: the collator draws from two global streams wherever it runs (the main process with
0 workers, the workers otherwise). Gradient accumulation over 2 micro-batches, warmup + cosine.
Each step's metrics line holds ``batch``, a checksum of the step's micro-batches as the model
got them (crops, masks, labels), so a divergence names the first step whose data differ.

``--collator-seed N`` is the broken variant (issue 49): ``DataCollatorForLanguageModeling(seed=N)``
masks from a generator of its own, made at its first call and never saved, so a resumed run masks
from that generator's start again. ``TransformersTrainer`` refuses it unless ``strict=False``,
which the option passes: the run goes on and ``unbroken verify`` must catch the inexact resume.
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertTokenizer,
    DataCollatorForLanguageModeling,
    TrainingArguments,
    set_seed,
)

from unbroken.integrations import TransformersTrainer

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]


class CropThenMask:
    """Crop each sequence to a length drawn from ``random``, then the MLM collator."""

    def __init__(self, mlm: DataCollatorForLanguageModeling) -> None:
        self.mlm = mlm

    def __call__(self, examples: list[dict]) -> dict:
        cropped = []
        for ex in examples:
            ids = ex["input_ids"]
            keep = random.randint(4, len(ids))  # [CLS] + >= 2 tokens + [SEP]
            cropped.append({"input_ids": ids[: keep - 1] + ids[-1:]})
        return self.mlm(cropped)


class Trainer(TransformersTrainer):
    """Logs a checksum of the step's training micro-batches (``batch``) in its metrics line."""

    def compute_loss(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not model.training:  # evaluation: not a training micro-batch
            return super().compute_loss(model, inputs, *args, **kwargs)
        if getattr(self, "_sum_step", None) != self.state.global_step:
            self._sum_step, self._sum = self.state.global_step, 0
        ids, labels = inputs["input_ids"], inputs["labels"]
        weights = torch.arange(1, ids.numel() + 1).view_as(ids)
        self._sum = (self._sum * 1_000_003 + int(((ids * 131 + labels) * weights).sum())) % 2**61
        self.unbroken_log(batch=self._sum)
        return super().compute_loss(model, inputs, *args, **kwargs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--samples", type=int, default=36, help="sequences in the train set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--collator-seed",
        type=int,
        default=None,
        help="mask from the collator's own generator (not resumable; runs with strict=False)",
    )
    a = p.parse_args()

    torch.set_num_threads(1)
    set_seed(a.seed)  # the model's initial weights
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})
    config = BertConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    model = BertForMaskedLM(config)
    g = torch.Generator().manual_seed(1)

    def sequences(n: int) -> list[dict]:
        out = []
        for _ in range(n):
            length = int(torch.randint(8, 25, (), generator=g))
            body = torch.randint(5, len(WORDS), (length,), generator=g).tolist()
            out.append({"input_ids": [tokenizer.cls_token_id, *body, tokenizer.sep_token_id]})
        return out

    train, held_out = sequences(a.samples), sequences(8)
    mlm = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.25, seed=a.collator_seed)
    collator = CropThenMask(mlm)
    args = TrainingArguments(
        output_dir=a.run_dir,
        max_steps=a.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        dataloader_num_workers=a.workers,
        save_strategy="steps",
        save_steps=a.save_every,
        logging_steps=1,
        eval_strategy="steps" if a.eval_every else "no",
        eval_steps=a.eval_every or None,
        per_device_eval_batch_size=4,
        seed=a.seed,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=held_out if a.eval_every else None,
        data_collator=collator,
        strict=a.collator_seed is None,
    )
    trainer.train()
    print(f"done: {trainer.state.global_step} steps", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
