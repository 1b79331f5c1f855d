"""What reading a tensor table costs: a checkpoint of N one-byte tensors, every one in the state.

    .venv/bin/python bench/bench_table.py [--tensors 100000] [--repeats 5] [--quick]

Each measurement runs in a fresh process (tests/scripts/table_cost.py's way: the peak resident
memory's growth from a reset high-water mark, and the wall time), the variants interleaved:

  json.loads   ``json.loads`` of tensors.json alone: the floor of any reader that parses it
  table        ``CheckpointReader.tensor_infos()``: the table streamed, validated, in columns
  ls           ``unbroken ls``: every checkpoint verified (the table, every chunk's checksum)
  inspect      ``unbroken inspect`` (its output discarded): also the state and every row

Prints a table of medians (seconds, MB of peak growth, and that growth over the checkpoint's
size) and, last, one JSON line.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import gc, json, sys, time, contextlib, io
sys.path.insert(0, {root!r})
from tests._memory import peak, reset_peak
variant, run, ckpt = sys.argv[1:4]
import torch  # noqa: F401  (what every reader has loaded already)
from unbroken.cli import main
from unbroken.store import CheckpointReader
gc.collect()
base = reset_peak()
t0 = time.perf_counter()
if variant == "json.loads":
    with open(ckpt + "/tensors.json", "rb") as f:
        doc = json.loads(f.read())
elif variant == "table":
    infos = CheckpointReader(ckpt).tensor_infos()
else:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([variant, run]) == 0
took = time.perf_counter() - t0
print(json.dumps({{"seconds": took, "grown": peak() - base}}))
"""


def measure(variant: str, run: Path, ckpt: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(root=str(ROOT)), variant, str(run), str(ckpt)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="10,000 tensors, 3 repeats")
    a = p.parse_args()
    if a.quick:
        a.tensors, a.repeats = 10_000, 3
    from tests.process.test_store_tables import _tiny_tensors

    variants = ["json.loads", "table", "ls", "inspect"]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        size = _tiny_tensors(run, a.tensors, a.tensors)
        ckpt = run / "checkpoints" / "step-000000001"
        table_bytes = os.path.getsize(ckpt / "tensors.json")
        got: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(a.repeats):
            for v in variants:  # interleaved: the machine's drift hits every variant alike
                got[v].append(measure(v, run, ckpt))
    print(
        f"{a.tensors} one-byte tensors: checkpoint {size / 1e6:.1f} MB "
        f"(tensors.json {table_bytes / 1e6:.1f} MB), medians of {a.repeats}"
    )
    print(f"{'variant':<12} {'seconds':>8} {'peak MB':>8} {'x ckpt':>7}")
    out = {"bench": "table", "tensors": a.tensors, "checkpoint_bytes": size, "repeats": a.repeats}
    for v in variants:
        secs = statistics.median(r["seconds"] for r in got[v])
        grown = statistics.median(r["grown"] for r in got[v])
        print(f"{v:<12} {secs:8.2f} {grown / 1e6:8.1f} {grown / size:7.2f}")
        out[v] = {"seconds": round(secs, 3), "grown_bytes": int(grown)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
