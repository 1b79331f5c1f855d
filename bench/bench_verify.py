"""What `unbroken verify` costs: verify on the char-level LM vs one uninterrupted run of it.

    .venv/bin/python bench/bench_verify.py [--steps 60] [--repeats 3] [--interrupts 3]

Each repeat times, in alternating order, one plain run of examples/char_lm.py and one
`unbroken verify` of the same command (the CLI as a user runs it: a reference run, an
interrupted run relaunched after each of K interruptions, the comparison). Prints a table of
medians and, last, one JSON line. Verify is two runs plus a start-up and up to `save_every`
redone steps per interruption, so its ratio to one run is a little over 2; the target is <= 3.
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

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "char_lm.py"
TARGET = 3.0


def plain(args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, str(SCRIPT), "--run-dir", d, *args],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        return time.perf_counter() - t0


def verify(args: list[str], interrupts: int, seed: int) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "unbroken", "verify", "--json", "--quiet"]
    cmd += ["--interrupts", str(interrupts), "--seed", str(seed), "--"]
    cmd += [sys.executable, str(SCRIPT), "--run-dir", "{run_dir}", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    took = time.perf_counter() - t0
    if not proc.stdout:
        raise SystemExit(f"unbroken verify failed:\n{proc.stderr[-3000:]}")
    return took, json.loads(proc.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--interrupts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=None, help="OMP_NUM_THREADS for every training process"
    )
    a = p.parse_args()
    if a.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
    args = ["--steps", str(a.steps), "--save-every", str(a.save_every)]
    args += ["--workers", str(a.workers)]

    plain_s: list[float] = []
    verify_s: list[float] = []
    parts: dict[str, list[float]] = {"reference": [], "interrupted": [], "compare": []}
    launches: list[int] = []
    passed = True
    for r in range(a.repeats):
        order = ("plain", "verify") if r % 2 == 0 else ("verify", "plain")
        for what in order:
            if what == "plain":
                plain_s.append(plain(args))
            else:
                took, report = verify(args, a.interrupts, seed=r)
                verify_s.append(took)
                passed = passed and bool(report.get("passed"))
                launches.append(int(report.get("launches", 0)))
                for k in parts:
                    parts[k].append(float(report.get("seconds", {}).get(k, float("nan"))))
        print(f"repeat {r + 1}: plain {plain_s[-1]:.1f} s, verify {verify_s[-1]:.1f} s", flush=True)

    med = statistics.median
    ratio = med(verify_s) / med(plain_s)
    print()
    print(
        f"char_lm --steps {a.steps} --save-every {a.save_every} --workers {a.workers}, "
        f"verify --interrupts {a.interrupts}; {a.repeats} repeats, interleaved, medians; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    print()
    print("| what | seconds |")
    print("| --- | ---: |")
    print(f"| one uninterrupted run | {med(plain_s):.1f} |")
    print(f"| unbroken verify, total | {med(verify_s):.1f} |")
    for k, v in parts.items():
        print(f"| - {k} | {med(v):.1f} |")
    print(f"| ratio verify / run | {ratio:.2f} (target <= {TARGET:g}) |")
    print()
    print(
        json.dumps(
            {
                "bench": "verify",
                "steps": a.steps,
                "save_every": a.save_every,
                "interrupts": a.interrupts,
                "repeats": a.repeats,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "plain_s": round(med(plain_s), 2),
                "verify_s": round(med(verify_s), 2),
                "verify_parts_s": {k: round(med(v), 2) for k, v in parts.items()},
                "launches": med(launches),
                "ratio": round(ratio, 3),
                "target": TARGET,
                "ok": ratio <= TARGET,
                "all_passed": passed,
            }
        )
    )


if __name__ == "__main__":
    main()
