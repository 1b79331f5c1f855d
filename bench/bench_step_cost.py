"""What unbroken adds to a training step, in CPU time and wall time, precise enough to judge 1%.

    .venv/bin/python bench/bench_step_cost.py [--before REV] [--repeats 9] [--workers 0 2]
                                              [--steps 300] [--rounds 9] [--only PART ...]

The loop is bench_hot_path's: a 128-512-512-10 MLP, batch 64, SGD, one torch thread, over a
dataset whose ``__getitem__`` adds ``torch.randn`` noise (so unbroken reseeds torch's global
stream per sample). Three libraries: ``plain`` (a hand-written loop over
``torch.utils.data.DataLoader``), ``before`` (unbroken at ``--before``, default main) and
``after`` (this tree), each ``Run`` + ``unbroken.MapLoader`` with default settings (metrics
log and signal handlers on, no saves).

The figure that judges the overhead is **CPU time a step of the whole process tree**: user +
system of the training process and of every DataLoader worker, read from each process's own
CPU clock (``clock_gettime`` of the process's CPU-time clock: nanoseconds, not the 10 ms ticks
of /proc/PID/stat). On a shared 2-core machine wall time swings with what else runs; CPU time
is what this process tree itself spent and barely moves with the neighbours' load. Wall time
is reported beside it (with workers it also says whether the workers keep up).

Parts (``--only``):

``proc``     one fresh process per (library, workers) and repeat, the libraries' order rotating
             per repeat; each trains ``--steps`` timed steps after 30 warm-up steps. Each
             repeat gives a ratio (library / plain, CPU and wall); reported: the median over
             ``--repeats`` and the spread (min..max and the interquartile range).
``inproc``   plain and unbroken in one process (one process per library: ``before``, then
             ``after``, then again, ``--repeats`` // 3 + 1 times each), taking turns in blocks
             of 40 steps for ``--rounds`` rounds; the CPU a step of a block is the process's
             own CPU during the block plus what that variant's own workers spent during the
             round. Reported: the median of the per-round ratios and its spread.
``run_step`` the ``run.step(loss=loss)`` call alone, in that loop (0 workers), per library:
             its CPU time (the calling thread's), the mean over all calls (what a step pays,
             the periodic flushes of the metrics log included) and the median call, and the
             median wall time of a call, in microseconds.
``seeding``  the loader's per-sample seeding alone: ``SampleSeeder.fetch`` of 64 samples of
             the torch-noise dataset against ``[dataset[i] ...]``, watched (the default) and
             with torch's stream named, in microseconds added a sample.

Every part runs ``before`` and ``after`` in separate, alternating processes. The last line is
one JSON object. bench/README.md says how to read it on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _revision import library_at  # bench/, first on sys.path when run as a script

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, tempfile
import torch
import unbroken  # from PYTHONPATH (the library measured) before bench_hot_path puts the tree first
sys.path.insert(0, sys.argv[1])
from bench_hot_path import Noisy
import bench_step_cost as b

torch.set_num_threads(1)
part, arg = sys.argv[2], json.loads(sys.argv[3])
data = Noisy(64 * 4000, 128, 10, "torch")
root = tempfile.mkdtemp(prefix="unbroken-step-cost-")
print(json.dumps(getattr(b, "child_" + part)(data, root, **arg)))
"""


# ---- measured in the child processes ------------------------------------------------------------


def cpu_of(pid: int) -> float:
    """Seconds of CPU (user + system, every thread) process ``pid`` has used: its CPU-time
    clock (``clock_getcpuclockid``; CPUCLOCK_SCHED, process-wide), nanosecond-precise."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        return 0.0  # gone: what it used is no longer readable (workers live through the run)


def children() -> set[int]:
    """This process's live child processes (the loaders' workers)."""
    me, out = os.getpid(), set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            out.add(int(name))
    return out


def tree_cpu(pids: set[int]) -> float:
    return cpu_of(os.getpid()) + sum(cpu_of(p) for p in pids)


def _variant(name: str, data: Any, workers: int, root: str) -> Any:
    from bench_hot_path import plain, with_unbroken

    dims = [128, 512, 512, 10]
    if name == "plain":
        return plain(dims, data, 64, workers)
    return with_unbroken(dims, data, 64, workers, os.path.join(root, name))


def child_proc(data: Any, root: str, variant: str, workers: int, steps: int) -> dict[str, float]:
    """One library alone: 30 warm-up steps, then ``steps`` timed ones."""
    gen = _variant(variant, data, workers, root)
    for _ in range(30):
        next(gen)
    pids = children()
    c0, t0 = tree_cpu(pids), time.perf_counter()
    for _ in range(steps):
        next(gen)
    wall, cpu = time.perf_counter() - t0, tree_cpu(pids) - c0
    gen.close()
    return {"wall_ms": wall / steps * 1e3, "cpu_ms": cpu / steps * 1e3, "workers_seen": len(pids)}


def child_inproc(
    data: Any, root: str, workers: int, rounds: int, block: int = 40
) -> dict[str, list[float]]:
    """plain and unbroken in one process, taking turns: per round, each one's wall and CPU a
    step (the process's CPU during its block + its own workers' CPU over the round)."""
    gens, own = {}, {}
    for name in ("plain", "unbroken"):
        before = children()
        gens[name] = _variant(name, data, workers, root)
        for _ in range(block):
            next(gens[name])
        own[name] = children() - before
    out: dict[str, list[float]] = {f"{k}_{n}": [] for k in ("wall", "cpu") for n in gens}
    keys = list(gens)
    for r in range(rounds):
        start = {n: sum(cpu_of(p) for p in own[n]) for n in keys}
        mine: dict[str, float] = {}
        walls: dict[str, float] = {}
        for n in keys[r % 2 :] + keys[: r % 2]:
            next(gens[n])  # the first step after a switch is not counted
            c0, t0 = cpu_of(os.getpid()), time.perf_counter()
            for _ in range(block):
                next(gens[n])
            walls[n], mine[n] = time.perf_counter() - t0, cpu_of(os.getpid()) - c0
        for n in keys:
            workers_cpu = sum(cpu_of(p) for p in own[n]) - start[n]
            out[f"wall_{n}"].append(walls[n] / block * 1e3)
            out[f"cpu_{n}"].append((mine[n] + workers_cpu) / block * 1e3)
    for g in gens.values():
        g.close()
    return out


def child_run_step(data: Any, root: str, steps: int) -> dict[str, float]:
    """``run.step(loss=loss)`` alone, inside the MLP loop (0 workers)."""
    import torch
    import torch.nn.functional as F
    from bench_hot_path import mlp

    import unbroken

    torch.manual_seed(0)
    model = mlp([128, 512, 512, 10])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # MapLoader in this tree; a --before revision may predate the name (DataLoader then).
    loader_class = getattr(unbroken, "MapLoader", None) or unbroken.DataLoader
    loader = loader_class(data, 64, seed=0)
    calls, cpus, clock, cpu = [], [], time.perf_counter, time.thread_time
    with unbroken.Run(
        os.path.join(root, "run_step"), model=model, optimizer=opt, loader=loader,
        save_final=False, progress=False, max_steps=steps,
    ) as run:  # fmt: skip
        for x, y in run.loop(loader, epochs=10**9):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            c1, t1 = cpu(), clock()
            run.step(loss=loss)
            calls.append(clock() - t1)
            cpus.append(cpu() - c1)
    calls, cpus = calls[len(calls) // 10 :], cpus[len(cpus) // 10 :]  # warm-up
    # CPU time of the calling thread: wall time of a call on a loaded machine is mostly the
    # time the process waited for a core (a mean over calls is dominated by preemptions).
    return {
        "cpu_mean_us": statistics.fmean(cpus) * 1e6,
        "cpu_median_us": statistics.median(cpus) * 1e6,
        "wall_median_us": statistics.median(calls) * 1e6,
    }


def child_seeding(data: Any, root: str, n: int) -> dict[str, float]:
    """µs added a sample by ``SampleSeeder.fetch`` (64 samples), watched and torch-only."""
    try:
        from unbroken.data._global_streams import SampleSeeder
    except ImportError:  # its name before main's reorganisation
        from unbroken.data._streams import SampleSeeder  # type: ignore[no-redef]

    keys = [(0, i) for i in range(64)]
    watched = SampleSeeder(0, True)
    watched.fetch(data.__getitem__, keys)  # found by watching: outside the clock
    named = SampleSeeder(0, "torch")
    fns = {
        "plain": lambda: [data[i] for _, i in keys],
        "watched": lambda: watched.fetch(data.__getitem__, keys),
        "torch": lambda: named.fetch(data.__getitem__, keys),
    }
    got: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(n):
        for k, f in fns.items():
            t0 = time.thread_time()
            f()
            got[k].append(time.thread_time() - t0)
    med = {k: statistics.median(v) for k, v in got.items()}
    return {k: (med[k] - med["plain"]) / 64 * 1e6 for k in ("watched", "torch")}


# ---- the parent ----------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    q = len(s) // 4
    return {
        "median": round(statistics.median(s), 4),
        "min": round(s[0], 4),
        "max": round(s[-1], 4),
        "iqr": [round(s[q], 4), round(s[-1 - q], 4)],
    }


def show(x: dict[str, float], pct: bool = True) -> str:
    f = (lambda v: f"{v:+.2%}") if pct else (lambda v: f"{v:.2f}")
    lo, hi = x["iqr"]
    return f"{f(x['median'])} (IQR {f(lo)}..{f(hi)}, range {f(x['min'])}..{f(x['max'])})"


class Children:
    def __init__(self, libs: dict[str, Path]) -> None:
        self.libs = libs

    def run(self, lib: str, part: str, **arg: Any) -> Any:
        path = self.libs[lib] if lib != "plain" else self.libs["after"]
        env = {**os.environ, "PYTHONPATH": f"{path}{os.pathsep}{BENCH}"}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(BENCH), part, json.dumps(arg)],
            env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(),
        )  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(f"{lib} {part} {arg} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def part_proc(c: Children, a: argparse.Namespace, result: dict[str, Any]) -> None:
    names = ["plain", "before", "after"]
    for w in a.workers:
        got: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for i in range(a.repeats):
            order = names[i % 3 :] + names[: i % 3]
            for n in order:
                variant = "plain" if n == "plain" else "unbroken"
                got[n].append(c.run(n, "proc", variant=variant, workers=w, steps=a.steps))
        out: dict[str, Any] = {}
        for n in names:
            out[n] = {
                "cpu_ms": spread([r["cpu_ms"] for r in got[n]]),
                "wall_ms": spread([r["wall_ms"] for r in got[n]]),
            }
        for n in ("before", "after"):
            for k in ("cpu", "wall"):
                ratios = [
                    u[f"{k}_ms"] / p[f"{k}_ms"] - 1
                    for u, p in zip(got[n], got["plain"], strict=True)
                ]
                out[n][f"{k}_overhead"] = spread(ratios)
            print(
                f"proc    {w} workers {n:6s}: CPU {show(out[n]['cpu_overhead'])}; "
                f"wall {show(out[n]['wall_overhead'])}; plain "
                f"{out['plain']['cpu_ms']['median']:.3f} ms CPU, "
                f"{out['plain']['wall_ms']['median']:.3f} ms wall a step",
                flush=True,
            )
        result[f"proc_workers_{w}"] = out


def part_inproc(c: Children, a: argparse.Namespace, result: dict[str, Any]) -> None:
    for w in a.workers:
        per: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
        for i in range(a.repeats // 3 + 1):
            for n in ("before", "after") if i % 2 == 0 else ("after", "before"):
                got = c.run(n, "inproc", workers=w, rounds=a.rounds)
                for k in ("cpu", "wall"):
                    pairs = zip(got[f"{k}_unbroken"], got[f"{k}_plain"], strict=True)
                    ratios = [u / p - 1 for u, p in pairs]
                    per[n].setdefault(k, []).extend(ratios)
        out = {n: {f"{k}_overhead": spread(v) for k, v in per[n].items()} for n in per}
        for n in ("before", "after"):
            print(
                f"inproc  {w} workers {n:6s}: CPU {show(out[n]['cpu_overhead'])}; "
                f"wall {show(out[n]['wall_overhead'])}",
                flush=True,
            )
        result[f"inproc_workers_{w}"] = out


def part_simple(c: Children, a: argparse.Namespace, result: dict[str, Any], part: str) -> None:
    arg = {"steps": 3000} if part == "run_step" else {"n": 300}
    got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(max(3, a.repeats // 2)):
        for n in ("before", "after") if i % 2 == 0 else ("after", "before"):
            got[n].append(c.run(n, part, **arg))
    out = {n: {k: spread([r[k] for r in runs]) for k in runs[0]} for n, runs in got.items()}
    for n, fig in out.items():
        text = "; ".join(f"{k} {show(v, pct=False)} us" for k, v in fig.items())
        print(f"{part:8s} {n:6s}: {text}", flush=True)
    result[part] = out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default="main", help="git revision to compare with")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=300, help="timed steps a process (proc)")
    p.add_argument("--rounds", type=int, default=9, help="rounds a process (inproc)")
    p.add_argument("--workers", type=int, nargs="*", default=[0, 2])
    parts = ["run_step", "seeding", "proc", "inproc"]
    p.add_argument("--only", nargs="*", choices=parts, default=parts)
    a = p.parse_args()
    result: dict[str, Any] = {
        "bench": "step_cost", "revision": a.before, "repeats": a.repeats, "steps": a.steps,
        "rounds": a.rounds, "cpus": os.cpu_count(), "load_before": os.getloadavg(),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        c = Children({"before": library_at(a.before, Path(tmp) / "before"), "after": ROOT})
        for part in a.only:
            if part == "proc":
                part_proc(c, a, result)
            elif part == "inproc":
                part_inproc(c, a, result)
            else:
                part_simple(c, a, result, part)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
