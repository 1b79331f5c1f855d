"""What the buddy copy of in-memory snapshots costs: per step, and in each node's memory.

    .venv/bin/python bench/bench_node_snapshot.py [--repeats 5] [--width 1024] [--steps 30]

Two gloo ranks (one process each, on this machine) train an MLP whose state -- the model and
AdamW's two moments, replicated by DDP -- is about ``width * width * 8 * 3 * 4`` bytes per rank,
with a snapshot every step, in three set-ups, interleaved, ``--repeats`` times each:

- ``none``: no snapshot area (durable saves only): the loop's own cost;
- ``one-node``: both ranks share one area, as under one supervisor: whole snapshots;
- ``two-nodes``: each rank has its own area, as two nodes under two supervisors: each area
  commits its rank's part and a copy of the other rank's files (store/snapshot/_nodes.py).

Each rank times every ``run.step()`` call (a snapshot is taken inside it); the per-step cost of
a set-up is the median of rank 0's calls minus ``none``'s. The memory is the bytes in each
area at the end, each file once (a committed snapshot's data files are links to the slots): the
two slots of each rank's own tensors, the copy of the other node's files, and the JSON.
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOY = r"""
import json, os, sys, time
import torch, torch.nn.functional as F
import unbroken
width, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rank, world = unbroken.init_distributed()
torch.manual_seed(0)
layers = [torch.nn.Linear(width, width) for _ in range(8)]
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
every = 0 if os.environ.get("UNBROKEN_SNAPSHOT_DIR") is None else 1
run = unbroken.Run(os.environ["RUN_DIR"], model=model, optimizer=opt, save_every=10**6,
                   max_steps=steps, progress=False, snapshot_every=every)
x = torch.randn(16, width)
calls = []
for _ in run.loop(range(steps)):
    loss = F.mse_loss(model(x), x)
    opt.zero_grad(); loss.backward(); opt.step()
    t0 = time.perf_counter(); run.step(loss=loss); calls.append(time.perf_counter() - t0)
area = os.environ.get("UNBROKEN_SNAPSHOT_DIR")
seen = {}  # a committed snapshot's data files are links to the slots: count each once
if area:
    for d, _, files in os.walk(area):
        for f in files:
            st = os.stat(os.path.join(d, f))
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
used = sum(seen.values())
state = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
json.dump({"calls": calls[2:], "area_bytes": used, "state_bytes": state}, open(out, "w"))
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(setup: str, tmp: Path, width: int, steps: int, i: int) -> list[dict]:
    port, procs, reports = _port(), [], []
    base = tmp / f"{setup}-{i}"
    shm = Path(tempfile.mkdtemp(prefix="bench-node-", dir="/dev/shm"))
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank if setup != "two-nodes" else 0),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "RUN_DIR": str(base / "run"),
        }
        if setup != "none":
            area = shm / ("area" if setup == "one-node" else f"area-{rank}")
            env["UNBROKEN_SNAPSHOT_DIR"] = str(area)
        reports.append(base / f"rank{rank}.json")
        cmd = [sys.executable, "-c", TOY, str(width), str(steps), str(reports[-1])]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=900)[1] for p in procs]
    shutil.rmtree(shm, ignore_errors=True)
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(
            f"{setup}: ranks exited {[p.returncode for p in procs]}:\n{errs[0][-3000:]}"
        )
    return [json.loads(r.read_text()) for r in reports]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    setups = ["none", "one-node", "two-nodes"]
    got: dict[str, list[list[dict]]] = {s: [] for s in setups}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for i in range(a.repeats):
            order = setups if i % 2 == 0 else setups[::-1]
            for s in order:
                (tmp / f"{s}-{i}").mkdir()
                got[s].append(launch(s, tmp, a.width, a.steps, i))
    med = {s: statistics.median(c for rep in got[s] for c in rep[0]["calls"]) for s in setups}
    rows = {}
    for s in setups:
        last = got[s][-1]
        rows[s] = {
            "step_call_ms": round(med[s] * 1e3, 3),
            "snapshot_ms": round((med[s] - med["none"]) * 1e3, 3),
            "area_mb_per_rank_or_node": [round(r["area_bytes"] / 1e6, 1) for r in last],
        }
    state_mb = got["none"][0][0]["state_bytes"] / 1e6
    print(f"state per rank: {state_mb:.1f} MB (model + AdamW moments, replicated)")
    print(f"{'set-up':>10} {'run.step ms':>12} {'snapshot ms':>12} {'area MB':>16}")
    for s, r in rows.items():
        areas = "/".join(f"{x:.1f}" for x in r["area_mb_per_rank_or_node"])
        print(f"{s:>10} {r['step_call_ms']:>12.2f} {r['snapshot_ms']:>12.2f} {areas:>16}")
    print(
        json.dumps(
            {
                "bench": "node_snapshot",
                "when": time.strftime("%Y-%m-%d %H:%M"),
                "cpus": os.cpu_count(),
                "load_average": [round(os.getloadavg()[0], 2)],
                "repeats": a.repeats,
                "width": a.width,
                "state_mb_per_rank": round(state_mb, 1),
                "setups": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
