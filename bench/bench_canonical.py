"""What canonical micro-shards cost against plain DDP on 2 ranks, before and after a change.

    .venv/bin/python bench/bench_canonical.py [--quick] [--repeats N] [--steps N] [--before REV]

Two gloo ranks on 127.0.0.1 (one intra-op thread each) train the same MLP (2.1 M float32
parameters, global batch 48) with AdamW. Variants, each its own model and optimizer:

  ddp           DistributedDataParallel: backward all-reduces gradient buckets as they are ready
  after-K       unbroken.train.CanonicalGradients(net, K) of this tree: K/2 shards of 48/K
                samples per rank, each its own forward and backward, then the shard-order sum
                (K = 2, 4, 8)
  before-K      the same with unbroken/train/_canonical.py as it was at --before (default: the
                main this work started from), loaded beside this tree's in the same processes
  compute-K     the K/2 shards' forwards and backwards, then a one-element all-reduce (the
                ranks wait for each other, as any exchange makes them), no gradient exchange:
                the floor any exchange of K shard gradients starts from

A step is forward, backward, the gradient exchange, ``optimizer.step()``. Every repeat runs each
variant for ``--steps`` timed steps (after 3 untimed ones), in an order rotated by one per
repeat, so load that comes and goes falls on every variant alike. Per repeat: each variant's
median step over ddp's median step of the same repeat; reported: the median of those ratios over
the repeats and their spread (min..max), the median step in ms, and the median time of the
canonical exchange (rank 0, from the last shard's end to p.grad set). At the end every rank
checks that before-K and after-K trained to the same parameters, bit for bit (the shard-order
sum is the mode's contract: a faster exchange that changed bits would be a defect).

Memory and bytes are computed from the algorithms, exact for these buffers. before: K/W flat
shard gradients, a receive buffer of K rows (at most 4 M elements each) and the result; each rank
receives (W-1)/W x K x P elements. after: K/W flat shard gradients, a partial sum on ranks other
than the last (not on rank 0 when it holds one shard) and the result; a rank receives the partial
sum from the rank before it (P elements, none on rank 0) and the result from the last rank (P,
none on the last). DDP's ring all-reduce receives about 2 (W-1)/W x P.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
WORLD = 2
BATCH = 48
SHARDS = (2, 4, 8)
BEFORE = "4ccd876"  # main when the chain sum was built (the all-gather exchange)


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


def _load_before(path: str):
    """The module at ``path`` as a sibling of this tree's ``unbroken.train._canonical``: its
    relative imports (``.._dist``, ``..data._seeding``) resolve to this tree's package."""
    spec = importlib.util.spec_from_file_location("unbroken.train._canonical_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "CanonicalGradients"):  # its name before the rename
        module.CanonicalGradients = module.CanonicalShards
    return module


def worker(repeats: int, steps: int, before: str | None, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from unbroken.train import _canonical

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    local = BATCH // WORLD
    x, y = torch.randn(local, 512, generator=g), torch.randn(local, 512, generator=g)

    tick = torch.zeros(1)
    reduce_s: list[float] = []
    modules = {"after": _canonical}
    if before:
        modules["before"] = _load_before(before)
    for module in modules.values():
        original = module.CanonicalGradients._reduce

        def timed(self, layout, _original=original):  # the exchange: every rank alike
            t0 = time.perf_counter()
            _original(self, layout)
            reduce_s.append(time.perf_counter() - t0)

        module.CanonicalGradients._reduce = timed

    variants: dict[str, tuple] = {}
    names = ["ddp"]
    for k in SHARDS:
        names += [f"{m}-{k}" for m in modules] + [f"compute-{k}"]
    for name in names:
        model = _model()
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        kind, _, k = name.partition("-")
        canon = modules[kind].CanonicalGradients(net, int(k)) if kind in modules else None
        variants[name] = (net, opt, canon, int(k) if k else 0)
    params = sum(p.numel() for p in _model().parameters())

    def step(net, opt, canon, k) -> None:
        if canon is not None:
            for xs, ys in canon.shards(x, y):
                canon.backward(F.mse_loss(net(xs), ys))
        elif k:  # compute-K: the shards' work, gradients accumulated in p.grad, no exchange
            per = k // WORLD
            size = local // per
            with net.no_sync():
                for j in range(per):
                    xs, ys = x[j * size : (j + 1) * size], y[j * size : (j + 1) * size]
                    F.mse_loss(net(xs), ys).backward()
            dist.all_reduce(tick)
        else:
            F.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rounds: list[dict[str, float]] = []
    reduces: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        this: dict[str, float] = {}
        for name in order:
            net, opt, canon, k = variants[name]
            for _ in range(3):
                step(net, opt, canon, k)
            reduce_s.clear()
            dist.barrier()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step(net, opt, canon, k)
                times.append(time.perf_counter() - t0)
            this[name] = statistics.median(times)
            reduces[name].extend(reduce_s)
        rounds.append(this)
    same = {}
    for k in SHARDS:
        if "before" in modules:
            a = variants[f"after-{k}"][0].module.parameters()
            b = variants[f"before-{k}"][0].module.parameters()
            same[str(k)] = all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    if rank == 0:
        result = {
            "params": params,
            "rounds": rounds,
            "reduce_ms": {n: 1000 * statistics.median(v) for n, v in reduces.items() if v},
            "same_bits": same,
        }
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _before_module(rev: str, tmp: Path) -> str:
    archive = subprocess.run(
        ["git", "archive", rev, "unbroken/train/_canonical.py"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return str(tmp / "unbroken" / "train" / "_canonical.py")


def _memory(name: str, params: int) -> tuple[float, float]:
    """Extra MiB per rank (the most on any rank) and received MiB per step (the most)."""
    mib = 4 * params / 2**20
    if name == "ddp" or name.startswith("compute"):
        return 0.0, (2 * (WORLD - 1) / WORLD * mib if name == "ddp" else 0.0)
    kind, _, k_ = name.partition("-")
    k = int(k_)
    per = k // WORLD
    if kind == "before":
        bucket = min(params, 1 << 22)
        copy = per * bucket if params > bucket else 0
        return (per * params + k * bucket + copy) * 4 / 2**20 + mib, (WORLD - 1) / WORLD * k * mib
    partial = 0 if WORLD == 1 else 1  # rank 0 needs none with one shard, the others one
    if per == 1 and WORLD == 2:
        partial = 0
    return (per + partial) * mib + mib, (2 if WORLD > 2 else 1) * mib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="5 repeats of 6 steps")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--before", default=BEFORE, help="git revision to compare with ('' for none)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--module", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.repeats, a.steps = 5, 6
    if a.worker:
        worker(a.repeats, a.steps, a.module, a.worker)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench_canonical_"))
    out = tmp / "result.json"
    module = _before_module(a.before, tmp) if a.before else None
    port = str(_free_port())
    procs = []
    load_before = os.getloadavg()
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
        cmd += ["--module", module] if module else []
        procs.append(subprocess.Popen(cmd, env=env))
    if any(proc.wait() != 0 for proc in procs):
        raise SystemExit("a rank failed")
    res = json.loads(out.read_text())
    load_after = os.getloadavg()
    params, rounds = res["params"], res["rounds"]
    names = list(rounds[0])
    ratios = {n: [r[n] / r["ddp"] for r in rounds] for n in names}
    step_ms = {n: 1000 * statistics.median(r[n] for r in rounds) for n in names}
    mib = 4 * params / 2**20
    print(
        f"{WORLD} gloo ranks, MLP {params / 1e6:.2f} M params ({mib:.1f} MiB of gradients), "
        f"batch {BATCH}, {a.repeats} interleaved repeats of {a.steps} steps"
    )
    print(
        f"{'variant':<12}{'x ddp':>7}{'  (min..max)':<15}{'step ms':>9}{'exchange ms':>13}"
        f"{'extra MiB':>11}{'recv MiB':>10}"
    )
    ordered = ["ddp"] + [n for k in SHARDS for n in names if n.endswith(f"-{k}")]
    mem = {n: _memory(n, params) for n in ordered}
    for n in ordered:
        red = res["reduce_ms"].get(n)
        spread = f"  ({min(ratios[n]):.2f}..{max(ratios[n]):.2f})"
        print(
            f"{n:<12}{statistics.median(ratios[n]):>7.2f}{spread:<15}{step_ms[n]:>9.2f}"
            f"{(f'{red:.2f}' if red else '-'):>13}{mem[n][0]:>11.1f}{mem[n][1]:>10.1f}"
        )
    if res["same_bits"]:
        print(f"after-K == before-K, bit for bit, on every rank: {res['same_bits']}")
    print(f"load average before {load_before}, after {load_after}")
    doc = {
        "bench": "canonical",
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "world": WORLD,
        "params": params,
        "batch": BATCH,
        "repeats": a.repeats,
        "steps": a.steps,
        "before": a.before,
        "over_ddp": {n: round(statistics.median(ratios[n]), 3) for n in ordered},
        "over_ddp_min": {n: round(min(ratios[n]), 3) for n in ordered},
        "over_ddp_max": {n: round(max(ratios[n]), 3) for n in ordered},
        "step_ms": {n: round(step_ms[n], 3) for n in ordered},
        "reduce_ms": {k: round(v, 3) for k, v in res["reduce_ms"].items()},
        "extra_mib": {n: round(mem[n][0], 1) for n in ordered},
        "recv_mib_per_step": {n: round(mem[n][1], 1) for n in ordered},
        "same_bits": res["same_bits"],
        "target_1_25": {
            n: statistics.median(ratios[n]) <= 1.25 for n in ordered if n.startswith("after")
        },
        "load_average": [round(v, 2) for v in (*load_before, *load_after)],
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
