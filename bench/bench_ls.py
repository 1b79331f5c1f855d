"""What `unbroken ls RUN` costs from the shell: a fresh process listing a run directory.

    .venv/bin/python bench/bench_ls.py [--repeats 7] [--checkpoints 3] [--before main]

The command as a user types it (``python -m unbroken ls RUN``), timed from the process start to
its exit, on a run directory of ``--checkpoints`` small checkpoints (every one verified:
manifest, tensor table, checksums). ``--before REV`` times the library at that git revision too
(bench/_revision.py), interleaved with the working tree's, so both see the same load. Also
says whether the listing imported torch (``-X importtime``). Prints medians and, last, one JSON
line.
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
sys.path.insert(0, str(ROOT))


def ls_once(src: Path, run: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "unbroken", "ls", str(run)],
        check=True,
        capture_output=True,
        env=env,
        cwd=src,
    )
    return time.perf_counter() - t0


def imports_torch(src: Path, run: Path) -> bool:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "unbroken", "ls", str(run)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=src,
    )
    return any(line.split("|")[-1].strip() == "torch" for line in proc.stderr.splitlines())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--before", metavar="REV", help="also time the library at this revision")
    p.add_argument("--quick", action="store_true", help="5 repeats")
    a = p.parse_args()
    if a.quick:
        a.repeats = 5
    from bench._revision import library_at
    from tests._store_helpers import make_run

    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        make_run(str(run), tuple(range(1, a.checkpoints + 1)))
        srcs = {"after": ROOT}
        if a.before:
            srcs = {"before": library_at(a.before, Path(d) / "before"), **srcs}
        times: dict[str, list[float]] = {k: [] for k in srcs}
        for r in range(a.repeats):
            for name in srcs if r % 2 == 0 else list(srcs)[::-1]:
                times[name].append(ls_once(srcs[name], run))
        torch_loaded = {name: imports_torch(src, run) for name, src in srcs.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    load = os.getloadavg()
    print(
        f"unbroken ls of {a.checkpoints} checkpoints, fresh process each, {a.repeats} repeats, "
        f"medians; load {load[0]:.2f}, {os.cpu_count()} CPUs"
    )
    print()
    print("| library | seconds | spread | imports torch |")
    print("| --- | ---: | --- | --- |")
    for k in srcs:
        spread = f"{min(times[k]):.2f}-{max(times[k]):.2f}"
        print(f"| {k} | {med[k]:.2f} | {spread} | {'yes' if torch_loaded[k] else 'no'} |")
    print()
    print(
        json.dumps(
            {
                "bench": "ls",
                "when": time.strftime("%Y-%m-%d %H:%M"),
                "cpus": os.cpu_count(),
                "load_average": [round(x, 2) for x in load[:1]],
                "checkpoints": a.checkpoints,
                "repeats": a.repeats,
                "before": a.before,
                "median_s": {k: round(v, 3) for k, v in med.items()},
                "spread_s": {k: [round(min(v), 3), round(max(v), 3)] for k, v in times.items()},
                "imports_torch": torch_loaded,
            }
        )
    )


if __name__ == "__main__":
    main()
