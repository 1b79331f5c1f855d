"""Resume on 1, 2, 3 ranks: the time ``Run()`` takes to open and resume, and the bytes each rank
reads, with this tree's library against an earlier revision's (``--before``), side by side.

    .venv/bin/python bench/bench_dist_resume.py [--before REV] [--repeats 5] [--width 131072]

Each world size W trains tests/scripts/toy_dist.py (FSDP2, gloo on CPU) one step with a hidden
layer ``W * width`` wide, so that every rank holds the same share of the state (about
``width * 48`` bytes: the model, AdamW's two moments and an EMA, each rank its shard), and saves
it. Then each repeat relaunches the W ranks once with each library, in alternating order, on that
run directory (the run is complete: ``Run()`` resumes and the loop ends at once). Each rank
reports the seconds ``Run()`` took and the bytes its read syscalls returned meanwhile
(``/proc/self/io`` ``rchar``: the page cache included, which is warm here -- this measures the
work each rank does, not the disk). The earlier revision is unpacked with ``git archive`` into a
temporary directory. Prints medians and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _revision import library_at  # bench/, first on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "scripts" / "toy_dist.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(lib: Path, world: int, run_dir: Path, width: int, io: Path | None) -> list[dict]:
    """``world`` ranks of the toy with ``lib`` on the path; each rank's report (with ``io``)."""
    port, procs = _port(), []
    args = ["--mode", "fsdp", "--width", str(width), "--steps", "1", "--save-every", "1"]
    args += ["--run-dir", str(run_dir)] + (["--io-log", str(io)] if io else [])
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONPATH": str(lib),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(TOY), *args]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=600)[1] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"ranks exited {[p.returncode for p in procs]}:\n" + errs[0][-3000:])
    if io is None:
        return []
    return [json.loads(Path(f"{io}.{r}").read_text()) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", default="main", help="git revision to compare with")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--width", type=int, default=131072)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3])
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        libs = {"before": library_at(a.before, tmp / "before"), "after": ROOT}
        rows = {}
        for world in a.worlds:
            run_dir = tmp / f"run-w{world}"
            launch(ROOT, world, run_dir, a.width * world, None)
            got: dict[str, list[list[dict]]] = {"before": [], "after": []}
            for i in range(a.repeats):
                order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
                for name in order:
                    io = tmp / f"io-{world}-{name}-{i}"
                    got[name].append(launch(libs[name], world, run_dir, a.width * world, io))
            rows[world] = {name: _summary(reports) for name, reports in got.items()}
            state = sum(f.stat().st_size for f in (run_dir / "checkpoints").glob("step-*/*"))
            rows[world]["checkpoint_bytes"] = state
    print(f"{'ranks':>5} {'lib':>6} {'resume s':>9} {'rank0 MB':>9} {'max other MB':>13}")
    for world, r in rows.items():
        for name in ("before", "after"):
            s = r[name]
            other = max(s["read_mb"][1:], default=float("nan"))
            print(
                f"{world:>5} {name:>6} {s['seconds']:>9.3f} {s['read_mb'][0]:>9.1f} {other:>13.1f}"
            )
    load = os.getloadavg()
    print(
        json.dumps(
            {
                "bench": "dist_resume",
                "when": time.strftime("%Y-%m-%d %H:%M"),
                "cpus": os.cpu_count(),
                "load_average": [round(load[0], 2)],
                "before": a.before,
                "repeats": a.repeats,
                "width_per_rank": a.width,
                "worlds": rows,
            }
        )
    )


def _summary(reports: list[list[dict]]) -> dict:
    """Medians over repeats: the slowest rank's ``Run()`` seconds, each rank's MB read."""
    world = len(reports[0])
    return {
        "seconds": round(statistics.median(max(r["seconds"] for r in rep) for rep in reports), 4),
        "read_mb": [
            round(statistics.median(rep[k]["read"] for rep in reports) / 1e6, 2)
            for k in range(world)
        ],
    }


if __name__ == "__main__":
    main()
