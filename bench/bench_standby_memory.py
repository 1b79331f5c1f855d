"""Peak resident memory of an ``unbroken run`` job whose script holds a large tensor before
``Run()``: the default (shallow) standby, the deep one and none, side by side.

    .venv/bin/python bench/bench_standby_memory.py [--gb 3] [--repeats 3] [--steps 40]

The script (written to a temporary directory) allocates ``--gb`` GB of float32 ones before
``Run()`` (touched, so resident), then trains a small model ``--steps`` steps under
``unbroken run``. A sampler sums VmRSS over the supervisor and all its descendants (trainer,
standby, persister) every 20 ms; the figure is the peak of that sum over the run. Variants run
in turn, interleaved per repeat. Prints the medians with (min..max), the ratio of each to
``--no-standby``, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from unbroken.process._tree import descendants  # noqa: E402

SCRIPT = """
import sys, torch, unbroken
held = torch.ones(int({gb} * 2**30 / 4))  # the user's data, resident before Run()
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
run = unbroken.Run(sys.argv[1], model=model, optimizer=opt, max_steps={steps}, save_every=1000,
                   progress=False)
for _ in run.loop(range(10**6)):
    x = torch.randn(32, 64)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    run.step(loss=loss)
    import time; time.sleep(0.05)
print(float(held[0]))
"""
VARIANTS = {"default": [], "deep": ["--standby", "deep"], "no-standby": ["--no-standby"]}


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def one(script: Path, run_dir: Path, opts: list[str]) -> float:
    cmd = [sys.executable, "-m", "unbroken", "run", "--quiet", *opts, "--"]
    cmd += [sys.executable, str(script), str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            total = rss_kb(proc.pid) + sum(rss_kb(p) for p in descendants(proc.pid))
            peak = max(peak, total)
            time.sleep(0.02)

    t = threading.Thread(target=sample)
    t.start()
    _, err = proc.communicate(timeout=900)
    done.set()
    t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{opts}: exit {proc.returncode}\n{err.decode()[-2000:]}")
    return peak / 2**20  # GB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gb", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    peaks: dict[str, list[float]] = {k: [] for k in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "holds.py"
        script.write_text(SCRIPT.format(gb=a.gb, steps=a.steps))
        for r in range(a.repeats):
            for name, opts in VARIANTS.items():
                peaks[name].append(one(script, Path(tmp) / f"run-{name}-{r}", opts))
                print(f"repeat {r} {name:11} peak {peaks[name][-1]:.2f} GB", flush=True)
    base = statistics.median(peaks["no-standby"])
    print(f"\nscript holding {a.gb:g} GB before Run(), {a.repeats} repeats, peak RSS of the job")
    out = {"bench": "standby_memory", "gb": a.gb}
    for name, v in peaks.items():
        med = statistics.median(v)
        print(f"  {name:11} {med:6.2f} GB ({min(v):.2f}..{max(v):.2f})  {med / base:.3f}x")
        out[f"{name}_gb"], out[f"{name}_ratio"] = med, med / base
    print(json.dumps(out))


if __name__ == "__main__":
    main()
