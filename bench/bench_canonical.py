"""What canonical micro-shards cost: step time, memory and communication vs plain DDP, 2 ranks.

    .venv/bin/python bench/bench_canonical.py [--quick] [--repeats N] [--steps N]

Two gloo ranks on 127.0.0.1 (one intra-op thread each) train the same MLP (2.1 M float32
parameters, global batch 48) with AdamW, variants taking turns in rotating order for
``--repeats`` rounds of ``--steps`` timed steps (after 3 untimed ones):

  ddp           DistributedDataParallel: backward all-reduces gradient buckets as they are ready
  canonical-K   unbroken.train.CanonicalShards(net, K): K/2 shards of 48/K samples per rank,
                each its own forward and backward; then an all-gather of the K flat shard gradients,
                which every rank adds in shard order (K = 2, 4, 8)

A step is forward, backward, the gradient exchange, ``optimizer.step()``. Reported: the median
step time, its ratio to ddp, and the part spent forming the canonical gradient (all-gather
and sum, timed by rank 0). Memory and bytes on the wire are computed from the algorithm, which
is exact for these buffers: per rank K/W flat shard gradients, a receive buffer of K rows of at
most 4 M elements, and the result (the new p.grad). Received per rank and step: DDP's ring
all-reduce about 2 (W-1)/W P elements, the all-gather (W-1)/W K P.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORLD = 2
BATCH = 48
SHARDS = (2, 4, 8)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.GELU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.GELU(),
        torch.nn.Linear(1024, 512),
    )


def worker(repeats: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import unbroken
    from unbroken.train import _canonical

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    local = BATCH // WORLD
    x, y = torch.randn(local, 512, generator=g), torch.randn(local, 512, generator=g)

    reduce_s: list[float] = []
    original = _canonical.CanonicalShards._reduce

    def timed_reduce(self, layout):  # the all-gather and the fixed-order sum
        t0 = time.perf_counter()
        original(self, layout)
        reduce_s.append(time.perf_counter() - t0)

    _canonical.CanonicalShards._reduce = timed_reduce  # type: ignore[method-assign]

    variants: dict[str, object] = {}
    for name in ["ddp", *(f"canonical-{k}" for k in SHARDS)]:
        model = _model()
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        canon = (
            None if name == "ddp" else unbroken.train.CanonicalShards(net, int(name.split("-")[1]))
        )
        variants[name] = (net, opt, canon)
    params = sum(p.numel() for p in _model().parameters())

    def step(net, opt, canon) -> None:
        if canon is None:
            F.mse_loss(net(x), y).backward()
        else:
            for xs, ys in canon.shards(x, y):
                canon.backward(F.mse_loss(net(xs), ys))
        opt.step()
        opt.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {n: [] for n in variants}
    reduces: dict[str, list[float]] = {n: [] for n in variants}
    names = list(variants)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            net, opt, canon = variants[name]  # type: ignore[misc]
            for _ in range(3):
                step(net, opt, canon)
            reduce_s.clear()
            dist.barrier()
            for _ in range(steps):
                t0 = time.perf_counter()
                step(net, opt, canon)
                times[name].append(time.perf_counter() - t0)
            reduces[name].extend(reduce_s)
    if rank == 0:
        result = {
            "params": params,
            "step_ms": {n: 1000 * statistics.median(v) for n, v in times.items()},
            "reduce_ms": {n: 1000 * statistics.median(v) for n, v in reduces.items() if v},
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 rounds of 10 steps")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.repeats, a.steps = 3, 10
    if a.worker:
        worker(a.repeats, a.steps, a.worker)
        return
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_canonical_{os.getpid()}.json"
    port = str(_free_port())
    procs = []
    load_before = os.getloadavg()[:2]
    for rank in range(WORLD):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, __file__, "--worker", str(out)]
        cmd += ["--repeats", str(a.repeats), "--steps", str(a.steps)]
        procs.append(subprocess.Popen(cmd, env=env))
    if any(proc.wait() != 0 for proc in procs):
        raise SystemExit("a rank failed")
    res = json.loads(out.read_text())
    out.unlink()
    params, ms = res["params"], res["step_ms"]
    mib = 4 * params / 2**20
    bucket = min(params, 1 << 22)
    print(f"2 gloo ranks, MLP {params / 1e6:.2f} M params ({mib:.1f} MiB of gradients), batch 48")
    print(
        f"{'variant':<14}{'step ms':>9}{'x ddp':>7}{'exchange ms':>13}{'extra MiB':>11}"
        f"{'recv MiB/step':>15}"
    )
    extra, recv = {}, {}
    for name, v in ms.items():
        if name == "ddp":
            extra[name] = 0.0
            recv[name] = 2 * (WORLD - 1) / WORLD * mib
        else:
            k = int(name.split("-")[1])
            # per rank: the shard buffers, one bucket's receive buffer (K rows), the result
            # (the new p.grad); a bucket's copy of the shard buffers when wider than a bucket
            per = k // WORLD
            copy = per * bucket if params > bucket else 0
            extra[name] = (per * params + k * bucket + copy) * 4 / 2**20 + mib
            recv[name] = (WORLD - 1) / WORLD * k * mib
        red = res["reduce_ms"].get(name)
        print(
            f"{name:<14}{v:>9.2f}{v / ms['ddp']:>7.2f}"
            f"{(f'{red:.2f}' if red else '-'):>13}{extra[name]:>11.1f}{recv[name]:>15.1f}"
        )
    doc = {
        "bench": "canonical",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "world": WORLD,
        "params": params,
        "batch": BATCH,
        "repeats": a.repeats,
        "steps": a.steps,
        "step_ms": {k: round(v, 3) for k, v in ms.items()},
        "over_ddp": {k: round(v / ms["ddp"], 3) for k, v in ms.items()},
        "reduce_ms": {k: round(v, 3) for k, v in res["reduce_ms"].items()},
        "extra_mib": {k: round(v, 1) for k, v in extra.items()},
        "recv_mib_per_step": {k: round(v, 1) for k, v in recv.items()},
        "load_average": [round(x, 2) for x in (*load_before, *os.getloadavg()[:1])],
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
