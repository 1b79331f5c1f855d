"""What ``run.step()`` itself costs inside a training loop, this tree against ``--before``.

    .venv/bin/python bench/bench_step_cost.py [--before REV] [--repeats 5] [--steps 2000]

bench_hot_path.py measures the whole step (loader, seeding, ``run.step``) against a plain
loop; on a shared 2-core machine its noise (several percent) hides a change of tens of
microseconds. This one times only the ``run.step(loss=loss)`` call, in the loop where it
runs (after forward, backward and ``optimizer.step()``, so caches are as cold as they are in
training): bench_hot_path's MLP, 0 workers, no saves, metrics log on. Each repeat is a fresh
process per library, the two libraries alternating; reported are the medians over repeats of
each process's median ``run.step`` in microseconds, and that as a fraction of the median
training step without it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _revision import library_at  # bench/, first on sys.path when run as a script

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, statistics, sys, tempfile, time
import torch
import torch.nn.functional as F
import unbroken
sys.path.insert(0, sys.argv[2])
from bench_hot_path import Noisy, mlp
torch.set_num_threads(1)
torch.manual_seed(0)
model = mlp([128, 512, 512, 10])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = unbroken.MapLoader(Noisy(8192, 128, 10, "none"), 64, seed=0)
steps, calls, clock = int(sys.argv[1]), [], time.perf_counter
with unbroken.Run(tempfile.mkdtemp(), model=model, optimizer=opt, loader=loader,
                  save_final=False, progress=False, max_steps=steps) as run:
    for x, y in run.loop(loader, epochs=10**9):
        t0 = clock()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        t1 = clock()
        run.step(loss=loss)
        calls.append((t1 - t0, clock() - t1))
calls = calls[len(calls) // 10:]  # warm-up
print(json.dumps({"train_us": statistics.median(c[0] for c in calls) * 1e6,
                  "step_us": statistics.median(c[1] for c in calls) * 1e6}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", default="main", help="git revision to compare with")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"before": library_at(a.before, Path(tmp) / "before"), "after": ROOT}
        got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for i in range(a.repeats):
            for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                env = {**os.environ, "PYTHONPATH": str(libs[name])}
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, str(a.steps), str(ROOT / "bench")],
                    env=env, capture_output=True, text=True, check=True, cwd=tmp,
                )  # fmt: skip
                got[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result: dict[str, object] = {"bench": "step_cost", "revision": a.before, "repeats": a.repeats}
    for name, runs in got.items():
        step = statistics.median(r["step_us"] for r in runs)
        train = statistics.median(r["train_us"] for r in runs)
        result[name] = {
            "run_step_us": round(step, 1),
            "train_step_us": round(train, 1),
            "fraction": round(step / train, 4),
            "each_run_step_us": [round(r["step_us"], 1) for r in runs],
        }
        print(f"{name:7s} run.step {step:7.1f} us  training step {train:8.1f} us  "
              f"run.step / step {step / train:.2%}")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
