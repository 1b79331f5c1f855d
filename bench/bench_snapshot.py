"""In-memory snapshots (issue 16): what one costs, and what restoring from memory saves.

    .venv/bin/python bench/bench_snapshot.py [--quick] [--repeats N]

On the 1 GB GPT-shaped state of bench_checkpoint.py (``--quick``: 0.09 GB), interleaved,
medians of N repeats:

  snapshot          ``SnapshotArea.save`` into /dev/shm, as ``Run`` takes one: ``copy_`` of
                    every tensor into the free one of two preallocated, mapped slots + xxh3 of
                    it, the slot hard-linked into the store's commit (JSON files, manifest
                    last, rename), then the previous snapshot's directory deleted
  copy floor        ``copy_`` of every tensor into preallocated buffers (one thread), and the
                    same with torch's default intra-op threads
  durable save      ``CheckpointStore.save`` to the disk under --dir (O_DIRECT + fsync)
  restore, disk     verified load of the durable checkpoint into the live tensors after
                    ``drop_caches`` (root; else warm, and the table says so)
  restore, memory   the same load from the snapshot in /dev/shm (what a relaunch on the same
                    node does)

Then the per-step cost in a training loop: a small char-level transformer (the char_lm
example's shape) trained for a number of steps with a snapshot after every step and without
any, and with one every k steps, k being the interval ``Run`` picks by default from a
snapshot's cost against the step time (``snapshot_every=None``); interleaved; the cost is the
extra time per step as a fraction of the step time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import build_state, drop_caches, registry_of, rotated, state_bytes  # noqa: E402

from unbroken.store import CheckpointReader, CheckpointStore  # noqa: E402
from unbroken.store.snapshot._area import SnapshotArea  # noqa: E402
from unbroken.train._snapshots import interval_for  # noqa: E402


def _load(reader: CheckpointReader, reg) -> None:
    trees = {**reader.global_trees(), **(reader.local_trees(0) or {})}
    names = reg.check_names(trees)
    targets = reg.plan(names, trees, reader.tensor_infos())
    reader.load_tensors(targets)
    reg.restore(names, trees, targets)


def state_part(shape: str, repeats: int, root: str) -> dict:
    model, opt = build_state(shape)
    reg = registry_of(model, opt)
    nbytes = state_bytes(reg)
    area = SnapshotArea(tempfile.mkdtemp(prefix="unbroken-bench-", dir="/dev/shm"))
    store = CheckpointStore(os.path.join(root, "disk"))
    bufs = {k: torch.empty_like(v) for k, v in reg.collect().tensors.items()}
    step = [0]

    def snapshot() -> float:
        step[0] += 1
        t0 = time.perf_counter()
        area.save(step[0], reg.collect(), {"epoch": 0})
        return time.perf_counter() - t0

    def copy() -> float:
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        for k, v in reg.collect().tensors.items():
            bufs[k].copy_(v)
        dt = time.perf_counter() - t0
        torch.set_num_threads(n)
        return dt

    def copy_threads() -> float:
        t0 = time.perf_counter()
        for k, v in reg.collect().tensors.items():
            bufs[k].copy_(v)
        return time.perf_counter() - t0

    def durable() -> float:
        step[0] += 1
        t0 = time.perf_counter()
        path = store.save(step[0], reg.collect(), {"epoch": 0})
        dt = time.perf_counter() - t0
        shutil.rmtree(path)
        return dt

    saves = {"snapshot": snapshot, "copy": copy, "copy_threads": copy_threads, "durable": durable}
    for fn in saves.values():
        fn()
    st: dict[str, list[float]] = {k: [] for k in saves}
    for r in range(repeats):
        for k in rotated(list(saves), r):
            st[k].append(saves[k]())
    # restore: one durable checkpoint and the snapshot of the very same state
    step[0] += 1
    disk_path = store.save(step[0], reg.collect(), {"epoch": 0})
    area.save(step[0], reg.collect(), {"epoch": 0})
    mem_path = os.path.join(area.root, "checkpoints", os.path.basename(disk_path))
    cold = drop_caches()
    loads = {
        "restore_disk": lambda: CheckpointReader(disk_path),
        "restore_memory": lambda: CheckpointReader(mem_path),
    }
    lt: dict[str, list[float]] = {k: [] for k in loads}
    for r in range(repeats):
        for k in rotated(list(loads), r):
            if cold:
                drop_caches()
            t0 = time.perf_counter()
            reader = loads[k]()
            reader.verify(checksums=True, data=False)
            _load(reader, reg)
            lt[k].append(time.perf_counter() - t0)
    shutil.rmtree(area.root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in {**st, **lt}.items()}
    return {"bytes": nbytes, "cold": cold, "s": med}


def loop_part(steps: int, repeats: int) -> dict:
    """A small char-level transformer (char_lm's default shape), with and without a snapshot
    after every step; returns the median seconds per step of each."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab, dim, ctx = 65, 128, 64
    layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, dim),
        torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False),
        torch.nn.Linear(dim, vocab),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    reg = registry_of(model, opt)  # type: ignore[arg-type]
    area = SnapshotArea(tempfile.mkdtemp(prefix="unbroken-bench-", dir="/dev/shm"))
    x = torch.randint(0, vocab, (32, ctx))
    n = [0]

    def train(every: int, timings: list[float] | None = None) -> float:
        """Seconds per step with a snapshot every ``every`` steps (0: none)."""
        t0 = time.perf_counter()
        for i in range(steps):
            t1 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            t2 = time.perf_counter()
            if every and (i + 1) % every == 0:
                n[0] += 1
                area.save(n[0], reg.collect(), {"epoch": 0})
                if timings is not None:
                    timings.append((time.perf_counter() - t2) / (t2 - t1))
        return (time.perf_counter() - t0) / steps

    first: list[float] = []
    train(1, first)
    # The interval Run picks by default from a snapshot's cost against the step time.
    every = interval_for(statistics.median(first), 1.0)
    res: dict[str, list[float]] = {"plain": [], "snapshot": [], "default": []}
    periods = {"plain": 0, "snapshot": 1, "default": every}
    for r in range(repeats):
        for k in rotated(list(res), r):
            res[k].append(train(periods[k]))
    shutil.rmtree(area.root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    state = state_bytes(reg)
    return {
        "state_bytes": state,
        "s_per_step": med,
        "cost": med["snapshot"] / med["plain"] - 1,
        "default_every": every,
        "cost_default": med["default"] / med["plain"] - 1,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    repeats = a.repeats or (3 if a.quick else 5)
    root = tempfile.mkdtemp(prefix="unbroken-bench-", dir=a.dir)
    try:
        sp = state_part("quick" if a.quick else "full", repeats, root)
        lp = loop_part(10 if a.quick else 30, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s, gb = sp["s"], sp["bytes"] / 1e9
    when = time.strftime("%Y-%m-%d %H:%M")
    print(
        f"\n{when}; load average {os.getloadavg()[0]:.2f}; state {gb:.3f} GB; medians of {repeats}"
    )
    print("\n| operation | seconds | vs copy floor |\n| --- | ---: | ---: |")
    for k, name in (
        ("snapshot", "in-memory snapshot (SnapshotArea.save: copy into a slot + xxh3 + commit)"),
        ("copy", "copy_ into preallocated buffers, one thread (floor)"),
        ("copy_threads", "copy_ into preallocated buffers, torch's default threads"),
        ("durable", "durable save to disk (O_DIRECT + fsync)"),
    ):
        print(f"| {name} | {s[k]:.3f} | {s[k] / s['copy']:.2f}x |")
    how = "cold (page cache dropped)" if sp["cold"] else "warm (not root: no drop_caches)"
    print(f"\n| restore, {how} | seconds |\n| --- | ---: |")
    print(f"| from the disk | {s['restore_disk']:.3f} |")
    print(f"| from the in-memory snapshot | {s['restore_memory']:.3f} |")
    ps = lp["s_per_step"]
    print(
        f"\nloop: {lp['state_bytes'] / 1e6:.1f} MB of state; {ps['plain'] * 1e3:.1f} ms/step "
        f"plain, {ps['snapshot'] * 1e3:.1f} ms/step with a snapshot every step: "
        f"cost {lp['cost'] * 100:.1f}%; every {lp['default_every']} step(s), the interval Run "
        f"picks by default: {ps['default'] * 1e3:.1f} ms/step, cost {lp['cost_default'] * 100:.1f}%"
    )
    print(json.dumps({"bench": "snapshot", "when": when, "state": sp, "loop": lp}))


if __name__ == "__main__":
    main()
