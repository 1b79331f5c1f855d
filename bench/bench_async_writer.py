"""Background writer of an async save: a thread (what unbroken does) or a separate process?

    .venv/bin/python bench/bench_async_writer.py [--quick] [--repeats N]

The training loop of bench_loop.py's part 2 (an MLP with ~100 MB of state with Adam,
hand-written, no ``Run``) saves every ``--save-every`` steps, and the save's writing (DCP + xxh3
+ fsync + manifest + rename: ``CheckpointStore.save``, the same work in every variant) runs in
the background while training goes on:

  none     no saves (the reference)
  thread   ``unbroken.store.AsyncSaver``: snapshot into reused buffers (``copy_``, 1 thread),
           then a thread writes and commits
  process  snapshot into reused shared-memory buffers (``share_memory_()``), then a persistent
           worker process (spawned once, outside the timing) writes and commits the same bytes

Both wait for the previous save before snapshotting the next one. The time of a variant runs
from its first step to the last step plus the wait for the last save; throughput = steps / time.
Variants interleaved, medians. The last line is one JSON object.
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
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_loop import dataset, interleaved, mlp, rates, train_step  # noqa: E402

from unbroken.state import Payload, Registry  # noqa: E402
from unbroken.store import AsyncSaver, CheckpointStore  # noqa: E402

META = {"epoch": 0, "samples": 0}


def writer_main(bufs: dict[str, torch.Tensor], run_dir: str, jobs: Any, done: Any) -> None:
    """The worker process: save what the trainer snapshotted into the shared buffers."""
    torch.set_num_threads(1)
    store = CheckpointStore(run_dir)
    done.put("ready")
    while True:
        job = jobs.get()
        if job is None:
            return
        step, trees, kinds = job
        try:
            t0 = time.perf_counter()
            store.save(step, Payload(global_trees=trees, tensors=bufs, kinds=kinds), META)
            store.apply_retention(step)
            done.put((step, time.perf_counter() - t0, None))
        except Exception as e:  # reported by the trainer
            done.put((step, 0.0, repr(e)))


class ProcessSaver:
    """Snapshot into shared memory; a persistent worker process writes and commits."""

    def __init__(self, reg: Registry, run_dir: str) -> None:
        self.reg = reg
        live = reg.collect().tensors
        self.bufs = {k: torch.empty_like(v).share_memory_() for k, v in live.items()}
        ctx = mp.get_context("spawn")
        self.jobs, self.done = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=writer_main, args=(self.bufs, run_dir, self.jobs, self.done))
        self.proc.start()
        if self.done.get() != "ready":  # started (imports done) before the clock starts
            raise RuntimeError("the writer process did not start")
        self.pending = False
        self.totals: list[float] = []

    def save(self, step: int) -> None:
        self.wait()
        payload = self.reg.collect()
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for k, t in payload.tensors.items():
                self.bufs[k].copy_(t.detach())
        finally:
            torch.set_num_threads(n)
        self.jobs.put((step, payload.global_trees, payload.kinds))
        self.pending = True

    def wait(self) -> None:
        if self.pending:
            _, took, err = self.done.get()
            if err is not None:
                raise RuntimeError(f"the writer process failed: {err}")
            self.totals.append(took)
            self.pending = False

    def close(self) -> None:
        self.wait()
        self.jobs.put(None)
        self.proc.join()


def one_run(
    mode: str, dims: list[int], data: Any, batch: int, steps: int, every: int, root: str
) -> dict[str, float]:
    torch.manual_seed(0)
    model = mlp(dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(
        data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    reg = Registry()
    reg.add("model", model)
    reg.add("optimizer", opt)
    run_dir = tempfile.mkdtemp(prefix=f"{mode}-", dir=root)
    batches = iter(loader)

    def step() -> None:
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        train_step(model, opt, x, y)

    step()  # Adam's state exists from here on; the buffers are sized after it
    thread_saver = AsyncSaver(CheckpointStore(run_dir)) if mode == "thread" else None
    proc_saver = ProcessSaver(reg, run_dir) if mode == "process" else None
    blocking: list[float] = []
    totals: list[float] = []
    ends = [time.perf_counter()]
    for i in range(1, steps + 1):
        step()
        if mode != "none" and i % every == 0:
            s0 = time.perf_counter()
            if thread_saver is not None:
                thread_saver.save(i, reg.collect(), META, after=thread_saver.store.apply_retention)
            elif proc_saver is not None:
                proc_saver.save(i)
            blocking.append(time.perf_counter() - s0)
            if thread_saver is not None and i > every:
                totals.append(thread_saver.last_total_seconds)
        ends.append(time.perf_counter())
    if thread_saver is not None:
        thread_saver.wait()
        totals.append(thread_saver.last_total_seconds)
    if proc_saver is not None:
        proc_saver.wait()
        totals = proc_saver.totals
    took = time.perf_counter() - ends[0]
    if proc_saver is not None:
        proc_saver.close()
    shutil.rmtree(run_dir)
    out = rates(ends, took, blocking)
    out["save_s"] = statistics.median(totals) if totals else 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller model, fewer steps, 3 repeats")
    p.add_argument("--repeats", type=int, default=None, help="default 5 (3 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 100)")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's)")
    p.add_argument("--dir", default=None, help="where run directories go (default /tmp)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    repeats = a.repeats or (3 if a.quick else 5)
    dims = [512, 1024, 1024, 10] if a.quick else [1024, 1536, 1536, 1536, 1536, 10]
    steps = a.steps or (40 if a.quick else 100)
    every = 10 if a.quick else a.save_every
    batch = 32
    data = dataset(batch * 200, dims[0], dims[-1])
    root = tempfile.mkdtemp(prefix="unbroken-bench-writer-", dir=a.dir)
    load_before = os.getloadavg()[0]
    modes = ["none", "thread", "process"]
    try:
        for m in modes:  # warm-up
            one_run(m, dims, data, batch, every + 1, every, root)
        res = interleaved(
            modes, repeats, lambda m: one_run(m, dims, data, batch, steps, every, root)
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in res.items()}
    none = med["none"]["steps_per_s"]
    eff = {m: d["efficiency"] / med["none"]["efficiency"] for m, d in med.items()}
    params = sum(a * b + b for a, b in zip(dims[:-1], dims[1:], strict=False))
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    print()
    print(
        f"{when}; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; load average "
        f"{load_before:.2f} before, {load_after:.2f} after; {params * 12 / 1e6:.0f} MB state, "
        f"save every {every} of {steps} steps; {repeats} repeats, interleaved, medians"
    )
    print()
    print(
        "| background writer | steps/s | vs no saves | efficiency vs no saves | "
        "blocking per save | save (background) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for m in modes:
        d = med[m]
        extra = (
            "- | - |"
            if m == "none"
            else f"{d['save_blocking_s'] * 1e3:.0f} ms | {d['save_s']:.2f} s |"
        )
        print(
            f"| {m} | {d['steps_per_s']:.2f} | {d['steps_per_s'] / none:.3f}x | "
            f"{eff[m]:.3f}x | {extra}"
        )
    print()
    print("Efficiency: steps x the run's median step / wall time (bench_loop.rates).")
    print()
    better = (
        "thread" if med["thread"]["steps_per_s"] >= med["process"]["steps_per_s"] else "process"
    )
    result = {
        "bench": "async_writer",
        "when": when,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "state_bytes": params * 12,
        "steps": steps,
        "save_every": every,
        "repeats": repeats,
        "median": {m: {k: round(v, 4) for k, v in d.items()} for m, d in med.items()},
        "thread_over_none": round(med["thread"]["steps_per_s"] / none, 3),
        "process_over_none": round(med["process"]["steps_per_s"] / none, 3),
        "thread_over_process": round(
            med["thread"]["steps_per_s"] / med["process"]["steps_per_s"], 3
        ),
        "efficiency_over_none": {m: round(v, 3) for m, v in eff.items()},
        "better": better,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
