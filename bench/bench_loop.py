"""What unbroken costs a training loop: per-step overhead, and throughput with periodic saves.

    .venv/bin/python bench/bench_loop.py [--quick] [--repeats N] [--rounds N] [--threads N]

Part 1, per-step overhead: the same small MLP (1.3 M parameters, batch 64: steps of ~10-20 ms
with one thread) trained by

  hand                a hand-written loop over a ``torch.utils.data.DataLoader``
  unbroken            ``unbroken.Run`` + ``unbroken.MapLoader`` (``run.epochs``,
                      ``run.step(loss=loss)``; metrics log and signal handlers on; no saves)
  unbroken_no_reseed  the same with ``MapLoader(reseed_globals=False)`` (no per-sample
                      reseeding of the global random streams)

(and, in the per-component figures only, ``reseed_globals="torch"``: torch's stream alone)

All three live in one process and take turns: ``--rounds`` rounds, each running a block of 20
steps of every variant (rotating order; the first step after a switch is not counted), so
that the machine's drift hits every variant alike. A step's time is the time between two step
ends; the table shows the median over all counted steps. Target: overhead <= 2%.

Part 2, throughput with saves: a wider MLP with ~100 MB of state (model + AdamW; ~70 MB with
``--quick``), trained for ``--steps`` steps with ``Run``: no saves, a durable save every
``--save-every`` steps (sync), and the same with ``async_save=True`` (the time includes the
wait for the last background save to commit). Variants interleaved over ``--repeats`` runs,
medians. Besides steps/s, each run's "efficiency" (steps x its own median step / wall time)
is reported: it cancels the drift of the machine's speed between runs, which on a busy VM is
larger than what a save costs. Target: async >= 0.97x no saves (on efficiency).

Torch uses one intra-op thread by default here (``--threads``): with two threads on two busy
cores, torch's thread pool turns a 15 ms step into hundreds of ms now and then.

The last line is one JSON object.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import unbroken  # noqa: E402

OVERHEAD_TARGET = 0.02
ASYNC_TARGET = 0.97


def mlp(dims: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def dataset(n: int, dim: int, classes: int) -> tud.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return tud.TensorDataset(torch.randn(n, dim, generator=g), torch.randint(classes, (n,)))


def train_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


# ---- part 1: per-step overhead ----------------------------------------------------------------


def hand_steps(dims: list[int], data: tud.Dataset, batch: int) -> Iterator[None]:
    """A hand-written loop, one step per ``next()``."""
    torch.manual_seed(0)
    model = mlp(dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = tud.DataLoader(
        data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    while True:
        for x, y in loader:
            train_step(model, opt, x, y)
            yield


def unbroken_steps(
    dims: list[int], data: tud.Dataset, batch: int, run_dir: str, reseed_globals: bool
) -> Iterator[None]:
    """The same loop with unbroken.Run + unbroken.MapLoader (defaults otherwise)."""
    torch.manual_seed(0)
    model = mlp(dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = unbroken.MapLoader(data, batch, seed=0, reseed_globals=reseed_globals)
    with unbroken.Run(
        run_dir, model=model, optimizer=opt, loader=loader, save_final=False, progress=False
    ) as run:
        for _ in run.epochs(10**9):
            for x, y in loader:
                loss = train_step(model, opt, x, y)
                run.step(loss=loss)
                yield


def overhead(
    dims: list[int], data: tud.Dataset, batch: int, rounds: int, block: int, root: str
) -> dict[str, list[float]]:
    """Step times of every variant, alternating blocks of ``block`` steps for ``rounds`` rounds
    (so that the machine's drift, large on a busy VM, hits every variant alike)."""
    gens = {
        "hand": hand_steps(dims, data, batch),
        "unbroken": unbroken_steps(dims, data, batch, os.path.join(root, "ov-a"), True),
        "unbroken_no_reseed": unbroken_steps(dims, data, batch, os.path.join(root, "ov-b"), False),
    }
    keys = list(gens)
    for g in gens.values():  # warm-up: allocator, kernels, the first epoch's order
        for _ in range(block):
            next(g)
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        s = r % len(keys)
        for k in keys[s:] + keys[:s]:
            g = gens[k]
            next(g)  # the first step after a switch warms caches: not counted
            last = time.perf_counter()
            for _ in range(block):
                next(g)
                now = time.perf_counter()
                times[k].append(now - last)
                last = now
    for g in gens.values():
        g.close()  # unbroken's: leaves the ``with Run`` (releases the lock)
    return times


LOSS = torch.tensor(1.0)


def timed_batches(loader: Any) -> Iterator[float]:
    """Seconds of each ``next()`` over one pass of ``loader``."""
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            return
        yield time.perf_counter() - t0


def hand_fetch(data: tud.Dataset, batch: int) -> Iterator[tuple[float, float]]:
    """(seconds of ``next(loader)``, 0) per batch of a torch DataLoader."""
    loader = tud.DataLoader(
        data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    while True:
        for fetch in timed_batches(loader):
            yield fetch, 0.0


def unbroken_fetch(
    data: tud.Dataset, batch: int, run_dir: str, reseed_globals: Any
) -> Iterator[tuple[float, float]]:
    """(seconds of ``next(loader)``, seconds of ``run.step(loss=...)``) per batch."""
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = unbroken.MapLoader(data, batch, seed=0, reseed_globals=reseed_globals)
    with unbroken.Run(
        run_dir, model=model, optimizer=opt, loader=loader, save_final=False, progress=False
    ) as run:
        for _ in run.epochs(10**9):
            for fetch in timed_batches(loader):
                t1 = time.perf_counter()
                run.step(loss=LOSS)
                yield fetch, time.perf_counter() - t1


def components(data: tud.Dataset, batch: int, n: int, root: str) -> dict[str, float]:
    """Median cost of what unbroken adds per step, measured without the training around it
    (alternating batches of the variants): far steadier than timing whole steps."""
    gens = {
        "hand": hand_fetch(data, batch),
        "unbroken": unbroken_fetch(data, batch, os.path.join(root, "cp-a"), True),
        "unbroken_no_reseed": unbroken_fetch(data, batch, os.path.join(root, "cp-b"), False),
        "unbroken_torch_only": unbroken_fetch(data, batch, os.path.join(root, "cp-c"), "torch"),
    }
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in gens}
    for i in range(n + 20):
        for k, g in gens.items():
            sample = next(g)
            if i >= 20:
                got[k].append(sample)
    for g in gens.values():
        g.close()
    out = {}
    for k, v in got.items():
        out[f"{k}_fetch"] = statistics.median(x[0] for x in v)
        out[f"{k}_step"] = statistics.median(x[1] for x in v)
    return out


# ---- part 2: throughput with saves ------------------------------------------------------------


def throughput(
    mode: str,
    dims: list[int],
    data: tud.Dataset,
    batch: int,
    steps: int,
    save_every: int,
    root: str,
) -> dict[str, float]:
    torch.manual_seed(0)
    model = mlp(dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = unbroken.MapLoader(data, batch, seed=0)
    run_dir = tempfile.mkdtemp(prefix=f"{mode}-", dir=root)
    run = unbroken.Run(
        run_dir,
        model=model,
        optimizer=opt,
        loader=loader,
        save_every=None if mode == "none" else save_every,
        async_save=mode == "async",
        save_final=False,
        progress=False,
    )
    # One untimed step first: Adam's state (half of the checkpoint) exists from here on.
    ends: list[float] = []
    blocking: list[float] = []
    for _ in run.epochs(10**6):
        for x, y in loader:
            loss = train_step(model, opt, x, y)
            s0 = time.perf_counter()
            run.step(loss=loss)
            ends.append(time.perf_counter())
            if run.last_saved_step == run.counters.step and len(ends) > 1:
                blocking.append(ends[-1] - s0)
            if len(ends) == steps + 1:
                break
        if len(ends) == steps + 1:
            break
    run.wait()
    took = time.perf_counter() - ends[0]
    run.close()
    shutil.rmtree(run_dir)
    return rates(ends, took, blocking)


def interleaved(
    modes: list[str], repeats: int, run_one: Callable[[str], dict[str, float]], label: str = ""
) -> dict[str, list[dict[str, float]]]:
    """Every mode's results: each repeat runs every mode once, in rotated order (so the
    machine's drift hits them alike), and prints their steps/s."""
    res: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(repeats):
        s = r % len(modes)
        for m in modes[s:] + modes[:s]:
            res[m].append(run_one(m))
        print(
            f"{label}repeat {r + 1}/{repeats}: "
            + ", ".join(f"{m} {res[m][-1]['steps_per_s']:.2f} steps/s" for m in modes),
            flush=True,
        )
    return res


def rates(ends: list[float], took: float, blocking: list[float]) -> dict[str, float]:
    """Throughput, and "efficiency": steps x the run's own median step / its wall time.

    Efficiency is 1.0 when no time was lost beyond a typical step; it normalizes each run by
    its own step speed, which drifts between runs on a busy machine far more than saves cost.
    """
    steps = len(ends) - 1
    median_step = statistics.median(b - a for a, b in zip(ends[:-1], ends[1:], strict=True))
    return {
        "steps_per_s": steps / took,
        "efficiency": steps * median_step / took,
        "save_blocking_s": statistics.median(blocking) if blocking else 0.0,
    }


def state_mb(dims: list[int]) -> float:
    params = sum(a * b + b for a, b in zip(dims[:-1], dims[1:], strict=False))
    return params * 4 * 3 / 1e6  # weights + Adam's two moments, float32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, a smaller model, 3 repeats")
    p.add_argument("--repeats", type=int, default=None, help="part 2 runs (default 7, quick 3)")
    p.add_argument("--steps", type=int, default=None, help="part 2 steps per run (default 100)")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--dir", default=None, help="where run directories go (default /tmp)")
    p.add_argument("--rounds", type=int, default=None, help="part 1 rounds (default 40)")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: steadier on a small, busy machine; 0: torch's)",
    )
    p.add_argument("--skip-throughput", action="store_true")
    a = p.parse_args()
    repeats = a.repeats or (3 if a.quick else 7)
    if a.threads:
        torch.set_num_threads(a.threads)
    root = tempfile.mkdtemp(prefix="unbroken-bench-loop-", dir=a.dir)
    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {"bench": "loop", "cpus": os.cpu_count(), "repeats": repeats}
    ok: dict[str, bool] = {}
    try:
        if not a.skip_overhead:
            dims = [256, 1024, 1024, 10]
            batch, block = 64, 20
            rounds = a.rounds or (8 if a.quick else 40)
            data = dataset(batch * 400, dims[0], dims[-1])
            comp = components(data, batch, 1000 if not a.quick else 200, root)
            times = overhead(dims, data, batch, rounds, block, root)
            med = {k: statistics.median(v) for k, v in times.items()}
            ratio = med["unbroken"] / med["hand"] - 1
            # Per round: the ratio of adjacent blocks' medians, to show how noisy it is.
            pairs = sorted(
                statistics.median(times["unbroken"][i : i + block])
                / statistics.median(times["hand"][i : i + block])
                - 1
                for i in range(0, len(times["hand"]), block)
            )
            q = len(pairs) // 4
            added = {
                k: comp[f"{k}_fetch"] - comp["hand_fetch"] + comp[f"{k}_step"]
                for k in ("unbroken", "unbroken_no_reseed", "unbroken_torch_only")
            }
            result["overhead"] = {
                "components_us": {k: round(v * 1e6, 1) for k, v in comp.items()},
                "added_ms": {k: round(v * 1e3, 3) for k, v in added.items()},
                "estimate": round(added["unbroken"] / med["hand"], 4),
                "estimate_no_reseed": round(added["unbroken_no_reseed"] / med["hand"], 4),
                "estimate_torch_only": round(added["unbroken_torch_only"] / med["hand"], 4),
                "model_params": sum(a * b + b for a, b in zip(dims[:-1], dims[1:], strict=False)),
                "batch": batch,
                "rounds": rounds,
                "steps_per_block": block,
                "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                "overhead": round(ratio, 4),
                "overhead_no_reseed": round(med["unbroken_no_reseed"] / med["hand"] - 1, 4),
                "per_round_overhead_iqr": [round(pairs[q], 4), round(pairs[-1 - q], 4)],
                "target": OVERHEAD_TARGET,
            }
            ok["overhead"] = added["unbroken"] / med["hand"] <= OVERHEAD_TARGET
            ok["overhead_no_reseed"] = added["unbroken_no_reseed"] / med["hand"] <= OVERHEAD_TARGET
            ok["overhead_torch_only"] = (
                added["unbroken_torch_only"] / med["hand"] <= OVERHEAD_TARGET
            )
        if not a.skip_throughput:
            dims = [1024, 1536, 1536, 1536, 1536, 10] if not a.quick else [512, 1024, 1024, 10]
            batch = 32
            steps = a.steps or (40 if a.quick else 100)
            every = a.save_every if not a.quick else 10
            data = dataset(batch * 200, dims[0], dims[-1])
            modes = ["none", "sync", "async"]
            throughput("async", dims, data, batch, every + 2, every, root)  # warm-up
            tp = interleaved(
                modes,
                repeats,
                lambda m: throughput(m, dims, data, batch, steps, every, root),
                "throughput ",
            )
            med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in tp.items()}
            none = med["none"]["steps_per_s"]
            eff = {m: v["efficiency"] for m, v in med.items()}
            result["throughput"] = {
                "state_mb": round(state_mb(dims), 1),
                "batch": batch,
                "steps": steps,
                "save_every": every,
                "steps_per_s": {m: round(v["steps_per_s"], 3) for m, v in med.items()},
                "save_blocking_s": {m: round(v["save_blocking_s"], 4) for m, v in med.items()},
                "sync_over_none": round(med["sync"]["steps_per_s"] / none, 3),
                "async_over_none": round(med["async"]["steps_per_s"] / none, 3),
                "efficiency": {m: round(v, 3) for m, v in eff.items()},
                "sync_over_none_efficiency": round(eff["sync"] / eff["none"], 3),
                "async_over_none_efficiency": round(eff["async"] / eff["none"], 3),
                "target_async_over_none": ASYNC_TARGET,
            }
            ok["async_throughput"] = eff["async"] / eff["none"] >= ASYNC_TARGET
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]
    result["load_average"] = [round(load_before, 2), round(load_after, 2)]
    result["when"] = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    result["torch_threads"] = torch.get_num_threads()
    result["ok"] = ok
    print()
    print(
        f"{result['when']}; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; "
        f"load average {load_before:.2f} before, {load_after:.2f} after; {repeats} repeats, "
        "interleaved, medians"
    )
    print()
    if "overhead" in result:
        o = result["overhead"]
        ms = o["median_ms"]
        c = o["components_us"]
        print(
            "| per step, small MLP | step (A/B timing) | vs hand | added (components) | vs hand |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
        print(f"| hand-written loop, torch DataLoader | {ms['hand']:.2f} ms | - | - | - |")
        print(
            f"| unbroken.Run + unbroken.MapLoader (default) | {ms['unbroken']:.2f} ms | "
            f"{o['overhead']:+.1%} | {o['added_ms']['unbroken']:.3f} ms | {o['estimate']:+.2%} |"
        )
        print(
            "| unbroken.Run + unbroken.MapLoader(reseed_globals=False) | "
            f"{ms['unbroken_no_reseed']:.2f} ms | {o['overhead_no_reseed']:+.1%} | "
            f"{o['added_ms']['unbroken_no_reseed']:.3f} ms | {o['estimate_no_reseed']:+.2%} |"
        )
        print(
            '| unbroken.Run + unbroken.MapLoader(reseed_globals="torch") | - | - | '
            f"{o['added_ms']['unbroken_torch_only']:.3f} ms | {o['estimate_torch_only']:+.2%} |"
        )
        lo, hi = o["per_round_overhead_iqr"]
        print()
        print(
            f"Components (medians): next(batch) torch {c['hand_fetch']:.0f} us, unbroken "
            f"{c['unbroken_fetch']:.0f} us, unbroken without reseeding "
            f"{c['unbroken_no_reseed_fetch']:.0f} us; run.step() {c['unbroken_step']:.0f} us. "
            f"A/B timing: {o['rounds']} rounds of {o['steps_per_block']}-step blocks per "
            f"variant; its per-round overhead (adjacent blocks) has an interquartile range of "
            f"{lo:+.1%} .. {hi:+.1%}, too wide to resolve 2%, so the target "
            f"(<= {OVERHEAD_TARGET:.0%}) is judged on the components."
        )
        print()
    if "throughput" in result:
        t = result["throughput"]
        print(
            f"| training, {t['state_mb']:.0f} MB state, save every {t['save_every']} | steps/s | "
            "vs no saves | efficiency | vs no saves | blocking per save |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        names = {"none": "no saves", "sync": "sync saves", "async": "async saves"}
        for m in ("none", "sync", "async"):
            sps = t["steps_per_s"][m]
            e = t["efficiency"][m]
            blk = t["save_blocking_s"][m]
            print(
                f"| {names[m]} | {sps:.2f} | {sps / t['steps_per_s']['none']:.3f}x | {e:.3f} | "
                f"{e / t['efficiency']['none']:.3f}x | "
                + (f"{blk * 1e3:.0f} ms |" if m != "none" else "- |")
            )
        print()
        print(
            "Efficiency = steps x the run's median step / wall time (see rates()); the target "
            f"(async >= {ASYNC_TARGET}x no saves) is judged on it."
        )
        print()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
