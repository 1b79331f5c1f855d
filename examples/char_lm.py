"""A character-level transformer on Milton's *Paradise Lost*, resumable bit for bit.

    python examples/char_lm.py --run-dir runs/char_lm [--steps N] [--save-every K]
    torchrun --nproc_per_node 2 examples/char_lm.py --run-dir runs/char_lm   # DDP, same contract
    torchrun --nproc_per_node 3 examples/char_lm.py --run-dir runs/c --canonical-shards 6

With ``--canonical-shards K`` the global batch is cut into K shards fixed by the data and the
gradient is summed over them in one order (``unbroken.train.CanonicalGradients``), so every world
size dividing K -- and a run resumed on another one -- ends with the very same bits.

Stop it any way you like (Ctrl-C, ``kill``, ``kill -9``, a cluster's preemption) and run the same
command again: it continues from the last checkpoint and ends exactly where an uninterrupted run
ends. On completion it writes ``RUN/final.safetensors`` (model and EMA weights) and
``RUN/trace.jsonl`` (one line per optimizer step: step, epoch, loss, lr, batch_size, samples).
It exits 0 when complete and 75 when stopped by a signal after saving (relaunch to continue).

What unbroken adds to a plain PyTorch loop is marked ``# unbroken``.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import unbroken  # unbroken

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


class Crops(torch.utils.data.Dataset):
    """Sample i is a window near position i * stride, shifted by a random crop offset."""

    def __init__(self, text: str, context: int, stride: int) -> None:
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.context, self.stride = context, stride
        self.n = (len(self.data) - context - stride - 1) // stride

    def __len__(self) -> int:
        return self.n

    def get_sample(self, i: int, generator: torch.Generator):  # unbroken: seeded per sample
        start = i * self.stride + int(torch.randint(self.stride, (1,), generator=generator))
        chunk = self.data[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block(dim, heads, 0.1) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos[:t])
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine to 10% of the peak: a pure function of the step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch (default 32; with --canonical-shards K the least multiple of K >= 32)",
    )
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--remote",
        metavar="URL",
        help="also keep every checkpoint in an object store (s3://bucket/prefix, needs "
        "unbroken[s3]); a relaunch with an empty --run-dir resumes from there",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on 2 cores)"
    )
    p.add_argument("--no-amp", action="store_true", help="disable bf16 autocast + GradScaler")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: this rank's GPU (under torchrun cuda:LOCAL_RANK); see docs/resume.md for "
        "the settings a bitwise GPU resume needs (unbroken.make_deterministic())",
    )
    p.add_argument(
        "--canonical-shards",
        type=int,
        default=0,
        metavar="K",
        help="bitwise the same on every world size dividing K (0: plain DDP)",
    )
    a = p.parse_args()
    shards = a.canonical_shards
    if shards < 0:
        p.error("--canonical-shards must be >= 0")
    if a.batch_size is None:
        a.batch_size = -(-32 // shards) * shards if shards else 32
    if shards and a.batch_size % shards:
        p.error(f"--batch-size {a.batch_size} must be a multiple of --canonical-shards {shards}")

    torch.set_num_threads(a.threads)
    if a.device == "cuda":
        unbroken.make_deterministic()  # unbroken: deterministic kernels, before CUDA is used
    rank, world = unbroken.init_distributed()  # unbroken: torchrun / srun; a no-op otherwise
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else None
    unbroken.seed_everything(a.seed)  # unbroken (or torch.manual_seed: model init must be seeded)
    data = Crops(CORPUS.read_text(encoding="utf-8"), a.context, stride=a.context // 2)
    model = CharLM(len(data.chars), a.context).to(device)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, a.steps, a.lr, warmup=a.steps // 10) / a.lr
    )
    amp = not a.no_amp
    scaler = torch.amp.GradScaler(a.device, enabled=amp)
    ema = unbroken.EMA(model, decay=0.99)  # unbroken
    loader = unbroken.MapLoader(  # unbroken: in place of torch's DataLoader; batch_size is
        data,  # the global batch: each of the ranks gets its slice
        batch_size=a.batch_size,
        shuffle=True,
        seed=a.seed,
        num_workers=a.workers,
        drop_last=bool(shards),  # canonical shards: every batch is a multiple of K
    )
    # unbroken: shard k of each global batch is the same on every world size dividing K
    canon = unbroken.train.CanonicalGradients(net, shards, scaler=scaler) if shards else None
    tracked = {"canonical": canon} if canon is not None else {}
    run = unbroken.Run(  # unbroken: resumes here if RUN has a checkpoint
        a.run_dir,
        model=net,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        ema=ema,
        loader=loader,
        **tracked,
        save_every=a.save_every,
        max_steps=a.steps,
        remote=a.remote,  # unbroken: None keeps checkpoints in --run-dir only
    )

    model.train()

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=amp):
            logits = net(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    for x, y in run.loop(loader):  # unbroken: batches across epochs until max_steps
        if device is not None:
            x, y = x.to(device), y.to(device)
        if canon is None:
            loss = loss_of(x, y)
            scaler.scale(loss).backward()
        else:  # unbroken: one forward/backward per shard; p.grad = their fixed-order mean
            for xs, ys in canon.shards(x, y):
                canon.backward(loss_of(xs, ys))
            loss = canon.loss
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        lr = sched.get_last_lr()[0]
        sched.step()
        ema.update()
        run.step(  # unbroken: logs (loss averaged over ranks), saves, exits 75 on SIGTERM
            loss=loss, lr=lr, batch_size=len(loader.last_indices), samples=loader.last_indices
        )

    if rank != 0:
        return 0
    unbroken.export_weights(os.path.join(a.run_dir, "final.safetensors"), model=model, ema=ema)
    trace = unbroken.train.write_trace(a.run_dir)  # RUN/trace.jsonl: step, epoch, loss, lr, ...
    print(f"done: {run.counters.step} steps, final loss {trace[-1]['loss']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
