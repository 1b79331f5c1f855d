"""What `unbroken verify` costs: verify / one uninterrupted run, on two scripts side by side.

    .venv/bin/python bench/bench_verify.py [--repeats 5] [--interrupts 3]

Two workloads, both examples/char_lm.py (one thread, no loader workers): `char_lm` (60 steps,
save every 10) and `short` (20 steps, save every 5: about a third of the training behind the
same start-up, a ~10 s script where start-up weighs most). Each repeat times, for each
workload, one plain run and one `unbroken verify` of the same command (the CLI as a user runs
it), in an order that alternates between repeats so that the machine's load hits both sides.
The ratio is taken per repeat (verify / the plain run beside it); the table gives its median
and spread (min..max), the medians of both sides, the launches verify forked, and the load
average. Beside the wall-clock ratio, the CPU ratio (user + system seconds of every process
each side ran, from getrusage): what the two sides cost a machine with no core to spare, where
running side by side buys nothing. Last, one JSON line. Target: verify <= 1.5x one run (K = 3,
same coverage), wall clock.

``--baseline DIR`` (an unbroken source tree, e.g. ``git archive main | tar -x -C DIR``) also
times that tree's ``unbroken verify`` in every repeat, next to this one, on the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "char_lm.py"
TARGET = 1.5
WORKLOADS = {
    "char_lm": ["--steps", "60", "--save-every", "10"],
    "short": ["--steps", "20", "--save-every", "5"],
}
COMMON = ["--workers", "0", "--threads", "1"]


def load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def cpu() -> float:
    """User + system seconds of every child process waited for so far (and theirs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def plain(args: list[str]) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        c0, t0 = cpu(), time.perf_counter()
        subprocess.run(
            [sys.executable, str(SCRIPT), "--run-dir", d, *args],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        return time.perf_counter() - t0, cpu() - c0


def verify(
    args: list[str], interrupts: int, seed: int, extra: list[str], tree: Path = ROOT
) -> tuple[float, float, dict]:
    cmd = [sys.executable, "-m", "unbroken", "verify", "--json", "--quiet", *extra]
    cmd += ["--interrupts", str(interrupts), "--seed", str(seed), "--"]
    cmd += [sys.executable, str(SCRIPT), "--run-dir", "{run_dir}", *args]
    c0, t0 = cpu(), time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    took, used = time.perf_counter() - t0, cpu() - c0
    if not proc.stdout:
        raise SystemExit(f"unbroken verify failed:\n{proc.stderr[-3000:]}")
    return took, used, json.loads(proc.stdout)


def spread(xs: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--interrupts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", choices=sorted(WORKLOADS), help="one workload")
    p.add_argument(
        "--verify-args", default="", help="extra verify options, e.g. '--no-fork --one-at-a-time'"
    )
    p.add_argument("--baseline", type=Path, help="another unbroken source tree to time too")
    a = p.parse_args()
    extra = a.verify_args.split()
    names = [a.only] if a.only else list(WORKLOADS)
    res: dict[str, dict[str, list]] = {
        n: {
            k: []
            for k in ("plain", "verify", "ratio", "cpu_ratio", "forked", "passed", "base", "bratio")
        }
        for n in names
    }
    loads: list[float] = []
    for r in range(a.repeats):
        loads.append(load())
        for i, name in enumerate(names):
            args = WORKLOADS[name] + COMMON
            first_plain = (r + i) % 2 == 0
            order = ["plain", "verify"] if first_plain else ["verify", "plain"]
            if a.baseline:
                order.insert(1, "base")
            for what in order:
                if what == "base":
                    took, _, report = verify(args, a.interrupts, r, extra, a.baseline)
                    res[name]["base"].append(took)
                    res[name]["passed"].append(bool(report.get("passed")))
                elif what == "plain":
                    took, plain_cpu = plain(args)
                    res[name]["plain"].append(took)
                else:
                    took, verify_cpu, report = verify(args, a.interrupts, r, extra)
                    res[name]["verify"].append(took)
                    res[name]["passed"].append(bool(report.get("passed")))
                    res[name]["forked"].append(report.get("launched", []).count("fork"))
            x = res[name]
            x["ratio"].append(x["verify"][-1] / x["plain"][-1])
            x["cpu_ratio"].append(verify_cpu / plain_cpu)
            if a.baseline:
                x["bratio"].append(x["base"][-1] / x["plain"][-1])
                print(
                    f"repeat {r + 1} {name}: baseline verify {x['base'][-1]:.1f} s, "
                    f"{x['bratio'][-1]:.2f}x",
                    flush=True,
                )
            print(
                f"repeat {r + 1} {name}: plain {x['plain'][-1]:.1f} s, verify "
                f"{x['verify'][-1]:.1f} s, {x['ratio'][-1]:.2f}x; CPU {plain_cpu:.1f} s vs "
                f"{verify_cpu:.1f} s, {x['cpu_ratio'][-1]:.2f}x (load {loads[-1]:.1f})",
                flush=True,
            )
    loads.append(load())
    print()
    print(
        f"verify --interrupts {a.interrupts} {' '.join(extra)} vs one run, {a.repeats} repeats "
        f"interleaved, median (min..max); load average {min(loads):.1f}..{max(loads):.1f} on "
        f"{os.cpu_count()} cores"
    )
    print()
    print(
        "| script | one run, s | verify, s | verify / run | CPU: verify / run | forked launches "
        "| passed |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in names:
        x = res[name]
        print(
            f"| {name} ({' '.join(WORKLOADS[name])}) | {spread(x['plain'])} | "
            f"{spread(x['verify'])} | {spread(x['ratio'], '.2f')} | "
            f"{spread(x['cpu_ratio'], '.2f')} | "
            f"{statistics.median(x['forked']):g} | {all(x['passed'])} |"
        )
    if a.baseline:
        print()
        print(f"baseline ({a.baseline}): verify, s | verify / run")
        for name in names:
            x = res[name]
            print(f"| {name} | {spread(x['base'])} | {spread(x['bratio'], '.2f')} |")
    print()
    out = {
        "bench": "verify",
        "interrupts": a.interrupts,
        "repeats": a.repeats,
        "verify_args": extra,
        "load": [min(loads), max(loads)],
        "target": TARGET,
    }
    for name in names:
        x = res[name]
        med = statistics.median(x["ratio"])
        out[name] = {
            "args": WORKLOADS[name],
            "plain_s": round(statistics.median(x["plain"]), 2),
            "verify_s": round(statistics.median(x["verify"]), 2),
            "ratio": round(med, 3),
            "ratio_min": round(min(x["ratio"]), 3),
            "ratio_max": round(max(x["ratio"]), 3),
            "cpu_ratio": round(statistics.median(x["cpu_ratio"]), 3),
            "ok": med <= TARGET,
            "all_passed": all(x["passed"]),
        }
        if a.baseline:
            out[name]["baseline_verify_s"] = round(statistics.median(x["base"]), 2)
            out[name]["baseline_ratio"] = round(statistics.median(x["bratio"]), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
