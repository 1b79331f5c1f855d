"""A byte-level language model trained from JSONL shards, resumable bit for bit.

    python examples/streaming_lm.py --run-dir runs/stream [--steps N] [--save-every K]
        [--num-workers W] [--data-dir DIR] [--source jsonl|hf|hf-iterable|sampler]
    torchrun --nproc_per_node 2 examples/streaming_lm.py --run-dir runs/stream   # DDP

The data is a directory of JSON-lines shards, one record ``{"id": ..., "text": ...}`` a line
(made from ``examples/data/corpus.txt`` on first use when ``--data-dir`` holds none). Each sample
is a random window of a record's text, drawn from a generator seeded by (seed, epoch, sample),
so the stream is the same for any ``--num-workers``, any world size and any resume point.
``--source`` picks how the shards are read -- the decision table of docs/data.md, in code:

* ``jsonl``: ``unbroken.data.JsonlShards`` in ``unbroken.MapLoader`` (the default);
* ``hf``: a Hugging Face ``datasets.Dataset`` built from the files, in ``unbroken.MapLoader``;
* ``hf-iterable``: that dataset as a sharded ``IterableDataset``, in
  ``unbroken.data.IterableShards``;
* ``sampler``: your own stateful sampler, in ``unbroken.data.SamplerLoader``.

Stop it any way you like and run the same command again: it continues from the last checkpoint
(also with another ``--num-workers``, or another number of ranks) and ends where an
uninterrupted run ends. On completion it writes ``RUN/final.safetensors`` and ``RUN/trace.jsonl``
(one line per step: step, epoch, loss, lr, samples -- the global ids of the step's samples).
It exits 0 when complete and 75 when stopped by a signal after saving (relaunch to continue).
What unbroken adds to a plain PyTorch loop is marked ``# unbroken``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import unbroken  # unbroken
from unbroken.data import IterableShards, JsonlShards, MapLoader, SamplerLoader

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def make_shards(out_dir: str, shards: int = 8, record_chars: int = 400) -> None:
    """Cut the corpus into records of about ``record_chars`` characters, dealt to shards."""
    text = CORPUS.read_text(encoding="utf-8")
    records = [text[i : i + record_chars] for i in range(0, len(text), record_chars)]
    os.makedirs(out_dir, exist_ok=True)
    for k in range(shards):
        tmp = os.path.join(out_dir, f".part-{k:03d}.jsonl")
        with open(tmp, "w", encoding="utf-8") as f:
            for i in range(k, len(records), shards):
                f.write(json.dumps({"id": i, "text": records[i]}) + "\n")
        os.replace(tmp, os.path.join(out_dir, f"part-{k:03d}.jsonl"))  # complete or absent


class Crop:
    """A record -> (input, target) bytes of a window at a random offset (the augmentation)."""

    def __init__(self, context: int) -> None:
        self.context = context

    def __call__(self, record: dict[str, Any], generator: torch.Generator):
        data = torch.tensor(list(record["text"].encode("utf-8")), dtype=torch.long)
        room = max(1, len(data) - self.context - 1)
        start = int(torch.randint(room, (1,), generator=generator))
        chunk = F.pad(data[start : start + self.context + 1], (0, self.context + 1))
        chunk = chunk[: self.context + 1]
        return chunk[:-1], chunk[1:]


class Windows:
    """A map-style dataset of records (JsonlShards or a datasets.Dataset) -> windows."""

    def __init__(self, records: Any, crop: Crop) -> None:
        self.records, self.crop = records, crop

    def __len__(self) -> int:
        return len(self.records)

    def get_sample(self, i: int, generator: torch.Generator):  # unbroken: seeded per sample
        return self.crop(self.records[i], generator)


class BlockShuffle:
    """A user's sampler: blocks of ``block`` indices in a shuffled order, each block in order.

    It keeps its own position (``state_dict``/``load_state_dict``), which is what
    ``unbroken.data.SamplerLoader`` needs to resume it exactly.
    """

    def __init__(self, n: int, block: int, seed: int) -> None:
        self.n, self.block, self.seed, self.epoch, self.next = n, block, seed, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        blocks = torch.randperm(-(-self.n // self.block), generator=g).tolist()
        return [i for b in blocks for i in range(b * self.block, min(self.n, (b + 1) * self.block))]

    def __iter__(self):
        order = self._order()
        while self.next < self.n:
            self.next += 1
            yield order[self.next - 1]
        self.next = 0  # the pass ended: the next one starts the (next) epoch from the top

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.next = state["epoch"], state["next"]


class ByteLM(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, dim)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(hidden, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.rnn(self.emb(x))[0]))


def build_loader(a: argparse.Namespace, files: list[str], rank: int) -> Any:
    crop = Crop(a.context)
    common = {"seed": a.seed, "num_workers": a.num_workers}
    if a.source == "jsonl":  # unbroken: shards read by any number of workers, resumed in O(1)
        return MapLoader(JsonlShards(files, augment=crop), a.batch_size, **common)
    if a.source == "sampler":  # unbroken: your own stateful sampler, resumed exactly
        records = JsonlShards(files)
        sampler = BlockShuffle(len(records), block=16, seed=a.seed)
        return SamplerLoader(
            Windows(records, crop), sampler=sampler, batch_size=a.batch_size, **common
        )
    import datasets  # local files only: nothing is downloaded

    cache = os.path.join(a.run_dir, "hf-cache", f"rank{rank}")  # ranks never share a cache
    table = datasets.Dataset.from_json(files, cache_dir=cache)
    if a.source == "hf":  # unbroken: a datasets.Dataset is map-style: use it as it is
        return MapLoader(Windows(table, crop), a.batch_size, **common)
    stream = table.to_iterable_dataset(num_shards=a.hf_shards)
    return IterableShards(stream, a.batch_size, augment=crop, **common)


def sample_ids(loader: Any) -> list[int]:
    """The global ids of the samples of the batch yielded last (every rank's)."""
    if isinstance(loader, IterableShards):
        return [shard * 1_000_000 + offset for shard, offset in loader.last_ids]
    return list(loader.last_indices)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--remote", metavar="URL", help="also keep checkpoints in s3://bucket/prefix")
    p.add_argument("--batch-size", type=int, default=24, help="global (all ranks together)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--data-dir", default=None, help="JSONL shards (default: RUN/../shards)")
    p.add_argument("--source", choices=["jsonl", "hf", "hf-iterable", "sampler"], default="jsonl")
    p.add_argument("--hf-shards", type=int, default=8, help="shards of --source hf-iterable")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    torch.set_num_threads(1)
    rank, world = unbroken.init_distributed()  # unbroken: torchrun / srun; a no-op otherwise
    data_dir = a.data_dir or os.path.join(os.path.dirname(os.path.abspath(a.run_dir)), "shards")
    if rank == 0 and not glob.glob(os.path.join(data_dir, "*.jsonl")):
        make_shards(data_dir)
    if world > 1:
        torch.distributed.barrier()  # the shards exist before any rank opens them
    files = sorted(glob.glob(os.path.join(data_dir, "*.jsonl")))

    unbroken.seed_everything(a.seed)  # unbroken: model init must be seeded
    model = ByteLM()
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = build_loader(a, files, rank)
    run = unbroken.Run(  # unbroken: resumes here if RUN has a checkpoint
        a.run_dir,
        model=net,
        optimizer=opt,
        scheduler=sched,
        loader=loader,
        save_every=a.save_every,
        remote=a.remote,  # unbroken: an object store tier (docs/remote.md)
        max_steps=a.steps,
    )

    model.train()
    for x, y in run.loop(loader):  # unbroken: batches across epochs until max_steps
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lr = sched.get_last_lr()[0]
        sched.step()
        run.step(loss=loss, lr=lr, samples=sample_ids(loader))  # unbroken: log, save, stop

    if rank == 0:
        unbroken.export_weights(os.path.join(a.run_dir, "final.safetensors"), model=model)
        trace = unbroken.train.write_trace(a.run_dir)  # RUN/trace.jsonl: step, epoch, loss, samples
        print(f"done: {run.counters.step} steps, final loss {trace[-1]['loss']:.4f}", flush=True)
    if world > 1:  # every rank leaves the process group together (gloo aborts otherwise)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
