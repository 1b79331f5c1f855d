"""What an in-memory snapshot costs a training step, as a % of the step, source against source.

    .venv/bin/python bench/bench_snapshot_step.py --src main=/path/to/main --src branch=. \
        [--kind char_lm --kind 1gb] [--repeats 5] [--steps 40] [--every 1|default] \
        [--copy NAME=step|background]

Each trainer is a fresh process of one source tree (``--src NAME=PATH``: its ``unbroken``),
training through ``unbroken.Run`` with a snapshot area in /dev/shm as ``unbroken run`` gives
one (``UNBROKEN_SNAPSHOT_DIR``), and the same trainer without one (``plain``). Per repeat,
every (source, set-up) pair runs once, in rotated order, so load drifts hit all alike.

- ``char_lm``: examples/char_lm.py's model, optimizer, scheduler, GradScaler, EMA and loop
  (bf16 autocast, batch 32, context 64, one thread, ``--workers 0``): what a user runs.
- ``1gb``: five 4096x4096 linear layers with AdamW (1.0 GB of state: weights and two moments),
  batch 8, one thread: a step of a few hundred ms, most of it the optimizer's.

Per trainer: the median wall time of a whole step (loop body + ``run.step()``) over the steps
after the first ``--skip`` (the default interval is chosen by then); the process's CPU time
(every thread) per step likewise. The cost of a repeat is snapshot / plain - 1 of the same
source in the same repeat; the table gives the median over repeats and the spread (min..max).
``--every 1`` forces a snapshot every step; ``default`` leaves ``snapshot_every`` unset (what
each source picks by itself; it says what it picked on stderr, shown here). ``--copy
NAME=MODE`` passes ``snapshot_copy=MODE`` to source NAME's trainers (one tree under two names
compares the two modes). Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time, importlib.util
src, kind, steps, every, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
sys.path.insert(0, src)
import torch, torch.nn as nn, torch.nn.functional as F
import unbroken
torch.set_num_threads(1)
kw = {} if every == "default" else {"snapshot_every": int(every)}
if os.environ.get("BENCH_SNAPSHOT_COPY"):
    kw["snapshot_copy"] = os.environ["BENCH_SNAPSHOT_COPY"]
run_dir = os.environ["RUN_DIR"]
times, cpus = [], []
if kind == "char_lm":
    path = os.path.join(src, "examples", "char_lm.py")
    spec = importlib.util.spec_from_file_location("char_lm", path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    unbroken.seed_everything(0)
    data = m.Crops(m.CORPUS.read_text(encoding="utf-8"), 64, stride=32)
    model = m.CharLM(len(data.chars), 64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    lr_of = lambda s: m.lr_at(s, steps, 3e-3, warmup=steps // 10) / 3e-3
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_of)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    ema = unbroken.EMA(model, decay=0.99)
    loader = unbroken.DataLoader(data, batch_size=32, shuffle=True, seed=0, num_workers=0)
    run = unbroken.Run(run_dir, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                       ema=ema, loader=loader, save_every=10**6, max_steps=steps,
                       progress=False, **kw)
    model.train()
    t0, c0 = time.perf_counter(), time.process_time()
    for x, y in run.loop(loader):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
        lr = sched.get_last_lr()[0]; sched.step(); ema.update()
        run.step(loss=loss, lr=lr)
        t1, c1 = time.perf_counter(), time.process_time()
        times.append(t1 - t0); cpus.append(c1 - c0); t0, c0 = t1, c1
else:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(5)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run = unbroken.Run(run_dir, model=model, optimizer=opt, save_every=10**6, max_steps=steps,
                       progress=False, **kw)
    x = torch.randn(8, 4096)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in run.loop(range(steps)):
        loss = model(x).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        run.step(loss=loss)
        t1, c1 = time.perf_counter(), time.process_time()
        times.append(t1 - t0); cpus.append(c1 - c0); t0, c0 = t1, c1
state = sum(t.numel() * t.element_size() for t in run.registry.collect().tensors.values())
snaps = run._checkpointer.snapshots
costs = list(getattr(snaps, "_costs", []) or [])  # what each cost the step (this branch on)
json.dump({"times": times, "cpus": cpus, "state_bytes": state, "costs": costs}, open(out, "w"))
"""


def trainer(
    src: str, kind: str, snap: bool, steps: int, every: str, tmp: Path, copy: str = ""
) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=tmp))
    out = run_dir / "out.json"
    env = {**os.environ, "RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": src}
    env["BENCH_SNAPSHOT_COPY"] = copy
    env.pop("UNBROKEN_SNAPSHOT_DIR", None)
    area = None
    if snap:
        area = tempfile.mkdtemp(prefix="bench-snap-", dir="/dev/shm")
        env["UNBROKEN_SNAPSHOT_DIR"] = area
    cmd = [sys.executable, "-c", CHILD, src, kind, str(steps), every, str(out)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        if area:
            shutil.rmtree(area, ignore_errors=True)
    if p.returncode != 0:
        raise SystemExit(f"{src} {kind} snap={snap}: exit {p.returncode}\n{p.stderr[-3000:]}")
    got = json.loads(out.read_text())
    said = re.findall(r"in-memory snapshot every [^\n]*", p.stderr)
    got["said"] = said[0] if said else ""
    shutil.rmtree(run_dir, ignore_errors=True)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", action="append", required=True, help="NAME=PATH of a source tree")
    p.add_argument("--kind", action="append", choices=["char_lm", "1gb"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the medians")
    p.add_argument("--every", default="1", help="1, k, or default (snapshot_every unset)")
    p.add_argument(
        "--copy",
        action="append",
        default=[],
        help="NAME=MODE: Run(snapshot_copy=MODE) for source NAME (step, background)",
    )
    a = p.parse_args()
    copies = dict(c.split("=", 1) for c in a.copy)
    srcs = dict(s.split("=", 1) for s in a.src)
    srcs = {k: str(Path(v).resolve()) for k, v in srcs.items()}
    kinds = a.kind or ["char_lm"]
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for kind in kinds:
            runs: dict[tuple[str, bool], list[dict]] = {(s, b): [] for s in srcs for b in (0, 1)}
            order = list(runs)
            for r in range(a.repeats):
                k = r % len(order)
                for s, b in order[k:] + order[:k]:
                    runs[(s, b)].append(
                        trainer(srcs[s], kind, bool(b), a.steps, a.every, tmp, copies.get(s, ""))
                    )
            for s in srcs:
                cost, cpu, step, path = [], [], [], []
                for plain, snap in zip(runs[(s, False)], runs[(s, True)], strict=True):
                    wp = statistics.median(plain["times"][a.skip :])
                    ws = statistics.median(snap["times"][a.skip :])
                    cp = statistics.median(plain["cpus"][a.skip :])
                    cs = statistics.median(snap["cpus"][a.skip :])
                    cost.append(ws / wp - 1)
                    cpu.append(cs / cp - 1)
                    step.append(wp)
                    if snap["costs"]:
                        path.append(statistics.median(snap["costs"]) / wp)
                rows.append(
                    {
                        "kind": kind,
                        "src": s,
                        "state_mb": round(runs[(s, True)][0]["state_bytes"] / 1e6, 1),
                        "step_ms": round(statistics.median(step) * 1e3, 2),
                        "wall_cost_pct": [round(c * 100, 2) for c in cost],
                        "cpu_cost_pct": [round(c * 100, 2) for c in cpu],
                        "said": runs[(s, True)][-1]["said"],
                        "path_cost_pct": [round(c * 100, 3) for c in path],
                    }
                )
    when = time.strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()[0]
    print(f"\n{when}; load average {load:.2f} at the end; {os.cpu_count()} CPUs; ", end="")
    print(f"every={a.every}; {a.repeats} repeats x {a.steps} steps (first {a.skip} left out)")
    print("\n| workload | source | state | step | snapshot cost, wall: median (min..max) |", end="")
    print(" CPU: median (min..max) |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        w, c = r["wall_cost_pct"], r["cpu_cost_pct"]
        print(
            f"| {r['kind']} | {r['src']} | {r['state_mb']} MB | {r['step_ms']} ms | "
            f"{statistics.median(w):.2f}% ({min(w):.2f}..{max(w):.2f}) | "
            f"{statistics.median(c):.2f}% ({min(c):.2f}..{max(c):.2f}) |"
        )
    for r in rows:
        if r["said"]:
            print(f"{r['kind']} {r['src']}: {r['said']}")
        if r["path_cost_pct"]:
            p = r["path_cost_pct"]
            print(
                f"{r['kind']} {r['src']}: on the step's path (the snapshot's own timing, "
                f"medians per repeat): {statistics.median(p):.3f}% "
                f"({min(p):.3f}..{max(p):.3f})"
            )
    print(
        json.dumps(
            {"bench": "snapshot_step", "when": when, "load": round(load, 2), "every": a.every}
            | {"rows": rows}
        )
    )


if __name__ == "__main__":
    main()
