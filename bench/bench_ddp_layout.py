"""What unbroken's fixed DDP reduction layout costs a training step, against plain DDP.

    .venv/bin/python bench/bench_ddp_layout.py [--world 3] [--repeats 9] [--steps 20] [--width 512]

``world`` gloo ranks on this machine (CPU), each holding two copies of one model (an embedding and
three ``width x width`` linear layers: two DDP buckets at width 512), one wrapped in plain
``DistributedDataParallel``, one in a DDP that ``unbroken.train._reduction`` made reduce in a
fixed layout (a communication hook). Each repeat times ``--steps`` training steps (forward,
backward with its all-reduce, AdamW step) of one, then of the other, alternating which goes
first; the first step of each DDP (its flat first-iteration bucket, which the hook reduces by
copies) is outside the timed steps and reported apart. Prints the medians per step with
(min..max) over repeats, the ratio of medians and the ratio pair by pair, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from unbroken.train._reduction import fix_reduction_layout

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    def model() -> torch.nn.Module:
        w = a.width
        layers: list[torch.nn.Module] = [torch.nn.Embedding(256, w)]
        for _ in range(3):
            layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(w, 256))

    nets = {}
    for name in ("plain", "fixed"):
        m = model()
        ddp = torch.nn.parallel.DistributedDataParallel(m)
        if name == "fixed":
            assert fix_reduction_layout(ddp) is None
        nets[name] = (ddp, torch.optim.AdamW(m.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (a.batch,), generator=g) for _ in range(8)]

    def steps(name: str, n: int) -> float:
        ddp, opt = nets[name]
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            x = batches[i % len(batches)]
            torch.nn.functional.cross_entropy(ddp(x), x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) / n

    first = {name: steps(name, 1) for name in nets}  # the first iteration, flat bucket
    steps("plain", 2)
    steps("fixed", 2)  # warm both after their rebuild
    times: dict[str, list[float]] = {"plain": [], "fixed": []}
    for r in range(a.repeats):
        order = ("plain", "fixed") if r % 2 == 0 else ("fixed", "plain")
        for name in order:
            times[name].append(steps(name, a.steps))
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"first": first, "times": times}, f)
    dist.barrier()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if "RANK" in os.environ:
        worker(a)
        return
    out = Path(f"/tmp/bench_ddp_layout.{os.getpid()}.json")
    port, procs = _port(), []
    for rank in range(a.world):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(a.world),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, __file__, *sys.argv[1:], "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env))
    for proc in procs:
        proc.wait(timeout=1800)
    data = json.loads(out.read_text())
    out.unlink()
    plain, fixed = data["times"]["plain"], data["times"]["fixed"]
    pairs = [f / p_ for f, p_ in zip(fixed, plain, strict=True)]
    med = {k: statistics.median(v) for k, v in data["times"].items()}
    print(f"{a.world} gloo ranks, width {a.width}, {a.repeats} repeats of {a.steps} steps")
    for k in ("plain", "fixed"):
        v = data["times"][k]
        print(f"  {k:6} DDP  {med[k] * 1e3:8.2f} ms/step  ({min(v) * 1e3:.2f}..{max(v) * 1e3:.2f})")
    print(
        f"  ratio of medians fixed/plain {med['fixed'] / med['plain']:.4f}; pair by pair "
        f"median {statistics.median(pairs):.4f} ({min(pairs):.4f}..{max(pairs):.4f})"
    )
    first = data["first"]
    print(
        f"  first iteration: plain {first['plain'] * 1e3:.1f} ms, "
        f"fixed {first['fixed'] * 1e3:.1f} ms"
    )
    print(
        json.dumps(
            {
                "bench": "ddp_layout",
                "world": a.world,
                "width": a.width,
                "plain_ms": med["plain"] * 1e3,
                "fixed_ms": med["fixed"] * 1e3,
                "ratio": med["fixed"] / med["plain"],
                "pair_ratio_median": statistics.median(pairs),
                "pair_ratio_min": min(pairs),
                "pair_ratio_max": max(pairs),
                "first_plain_ms": first["plain"] * 1e3,
                "first_fixed_ms": first["fixed"] * 1e3,
            }
        )
    )


if __name__ == "__main__":
    main()
