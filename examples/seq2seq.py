"""A tiny English-to-Spanish transformer on a parallel corpus, resumable bit for bit.

    python examples/seq2seq.py --run-dir runs/seq2seq [--steps N] [--save-every K]

The corpus is ``examples/data/parallel/train.en`` -> ``train.es`` (7,566 aligned lines), read
through ``unbroken.data.TextCorpus`` (an offset index, so any line is read in O(1)) and batched
by ``unbroken.data.TokenBatchLoader``: windows of samples are sorted by length and cut into
batches of at most ``--max-tokens`` padded tokens, so batch sizes vary.

Stop it any way you like (Ctrl-C, ``kill``, ``kill -9``, a cluster's preemption) and run the same
command again: it continues from the last checkpoint -- mid-window, mid-epoch -- and ends exactly
where an uninterrupted run ends. On completion it writes ``RUN/final.safetensors`` (model and EMA
weights) and ``RUN/trace.jsonl`` (one line per optimizer step: step, epoch, loss, lr,
batch_size, samples = the corpus line numbers of the step's batch). It exits 0 when complete
and 75 when stopped by a signal after saving (relaunch to continue).

Under ``torchrun --nproc_per_node N`` the same command trains with DDP: ``--max-tokens`` is the
global budget, each rank takes its slice of every batch, and rank 0 writes the outputs.

What unbroken adds to a plain PyTorch loop is marked ``# unbroken``.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import unbroken  # unbroken
from unbroken.data import CharVocab, TextCorpus, TokenBatchLoader, WordVocab  # unbroken

DATA = Path(__file__).parent / "data" / "parallel"
PAD, BOS, EOS = CharVocab.pad_id, CharVocab.bos_id, CharVocab.eos_id


def sample_tokens(item: tuple[list[int], list[int]]) -> int:
    """A pair's length in the budget: its longer side plus the BOS/EOS the collate adds."""
    return max(len(item[0]), len(item[1])) + 1


def pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def collate(items: list[tuple[list[int], list[int]]]):
    """(source + EOS, BOS + target, target + EOS), each padded to its longest row."""
    src = pad([s + [EOS] for s, _ in items])
    tgt_in = pad([[BOS] + t for _, t in items])
    tgt_out = pad([t + [EOS] for _, t in items])
    return src, tgt_in, tgt_out


class Translator(nn.Module):
    def __init__(self, src_vocab: int, tgt_vocab: int, dim: int = 64, layers: int = 2):
        super().__init__()
        self.src_emb = nn.Embedding(src_vocab, dim, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(tgt_vocab, dim, padding_idx=PAD)
        self.transformer = nn.Transformer(
            d_model=dim,
            nhead=4,
            num_encoder_layers=layers,
            num_decoder_layers=layers,
            dim_feedforward=4 * dim,
            dropout=0.1,
            batch_first=True,
        )
        self.head = nn.Linear(dim, tgt_vocab)
        pos = torch.arange(512).unsqueeze(1)
        freq = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
        pe = torch.zeros(512, dim)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        self.register_buffer("pe", pe, persistent=False)
        self.scale = math.sqrt(dim)

    def embed(self, emb: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return emb(ids) * self.scale + self.pe[: ids.shape[1]]

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)  # True = may not attend
        h = self.transformer(
            self.embed(self.src_emb, src),
            self.embed(self.tgt_emb, tgt_in),
            tgt_mask=causal,
            src_key_padding_mask=src == PAD,
            tgt_key_padding_mask=tgt_in == PAD,
            memory_key_padding_mask=src == PAD,
            tgt_is_causal=True,
        )
        return self.head(h)

    @torch.no_grad()
    def translate(self, src: list[int], max_len: int = 80) -> list[int]:
        """Greedy decoding (call in eval mode): encode once, then one token at a time."""
        ids = torch.tensor([src + [EOS]])
        with warnings.catch_warnings():  # eval mode's fast path warns about nested tensors
            warnings.simplefilter("ignore")
            memory = self.transformer.encoder(self.embed(self.src_emb, ids))
            out = [BOS]
            for _ in range(max_len):
                tgt = torch.tensor([out])
                t = tgt.shape[1]
                h = self.transformer.decoder(
                    self.embed(self.tgt_emb, tgt),
                    memory,
                    tgt_mask=torch.ones(t, t, dtype=torch.bool).triu(1),
                )
                nxt = int(self.head(h[0, -1]).argmax())
                if nxt == EOS:
                    break
                out.append(nxt)
        return out[1:]


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine to 10% of the peak: a pure function of the step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--remote", metavar="URL", help="also keep checkpoints in s3://bucket/prefix")
    p.add_argument("--max-tokens", type=int, default=1200, help="padded tokens per batch")
    p.add_argument("--window", type=int, default=512, help="samples sorted together")
    p.add_argument("--lines", type=int, default=None, help="use only the first N lines")
    p.add_argument("--vocab", choices=["char", "word"], default="char")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (a tiny model gains "
        "little from more, and loses much when cores are shared with workers or other jobs)",
    )
    p.add_argument("--index-dir", default=None, help="where the corpus index is cached")
    p.add_argument("--signal-at", type=int, default=None, help="(tests) signal self after step K")
    p.add_argument("--signal", choices=["TERM", "KILL", "INT", "USR1"], default="TERM")
    return p.parse_args(argv)


def load_data(a: argparse.Namespace):
    """The raw corpus, its vocabularies, the tokenized corpus and the token-budget loader."""
    paths = [DATA / "train.en", DATA / "train.es"]
    index_dir = a.index_dir or os.path.join(a.run_dir, "corpus-index")
    text = TextCorpus(paths, max_lines=a.lines, cache_dir=index_dir)  # unbroken
    Vocab = CharVocab if a.vocab == "char" else WordVocab
    src_vocab, tgt_vocab = Vocab.from_corpus(text, 0), Vocab.from_corpus(text, 1)
    corpus = TextCorpus(  # unbroken: item i = (source ids, target ids) of line i
        paths, tokenize=[src_vocab.encode, tgt_vocab.encode], max_lines=a.lines, cache_dir=index_dir
    )
    loader = TokenBatchLoader(  # unbroken: token-budget batches, resumable mid-window
        corpus,
        max_tokens=a.max_tokens,
        window=a.window,
        seed=a.seed,
        length_fn=sample_tokens,
        collate_fn=collate,
        num_workers=a.workers,
    )
    return text, src_vocab, tgt_vocab, loader


def main() -> int:
    a = parse_args()
    torch.set_num_threads(a.threads)
    rank, world = unbroken.init_distributed()  # unbroken: torchrun / srun; a no-op otherwise
    unbroken.seed_everything(a.seed)  # unbroken (or torch.manual_seed: model init must be seeded)
    text, src_vocab, tgt_vocab, loader = load_data(a)  # max_tokens is the global budget
    model = Translator(len(src_vocab), len(tgt_vocab))
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, a.steps, a.lr, warmup=max(1, a.steps // 10)) / a.lr
    )
    ema = unbroken.EMA(model, decay=0.99)  # unbroken
    run = unbroken.Run(  # unbroken: resumes here if RUN has a checkpoint
        a.run_dir,
        model=net,
        optimizer=opt,
        scheduler=sched,
        ema=ema,
        loader=loader,
        save_every=a.save_every,
        remote=a.remote,  # unbroken: an object store tier (docs/remote.md)
        max_steps=a.steps,
    )
    if a.signal_at == 0:
        os.kill(os.getpid(), getattr(signal, "SIG" + a.signal))

    model.train()
    for src, tgt_in, tgt_out in run.loop(loader):  # unbroken: batches until max_steps
        logits = net(src, tgt_in)
        loss = F.cross_entropy(
            logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, label_smoothing=0.1
        )
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lr = sched.get_last_lr()[0]
        sched.step()
        ema.update()
        run.step(  # unbroken: logs (loss averaged over ranks), saves, exits 75 on SIGTERM
            loss=loss, lr=lr, batch_size=len(loader.last_indices), samples=loader.last_indices
        )
        if a.signal_at is not None and run.counters.step == a.signal_at:
            os.kill(os.getpid(), getattr(signal, "SIG" + a.signal))

    if rank != 0:
        return 0
    unbroken.export_weights(os.path.join(a.run_dir, "final.safetensors"), model=model, ema=ema)
    trace = unbroken.train.write_trace(a.run_dir)
    model.eval()
    with ema.applied():
        source = text.text(0)[0]
        guess = tgt_vocab.decode(model.translate(src_vocab.encode(source)))
    print(f"done: {run.counters.step} steps, final loss {trace[-1]['loss']:.4f}", flush=True)
    print(f"  {source}\n  -> {guess}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
