"""Plain torch + gloo: does a DistributedDataParallel built mid-run (as a resumed process builds
one) reduce like the one that ran throughout? With unbroken's fixed reduction layout
(``unbroken.train._reduction``) and without it (``--plain``).

Three DDPs over a model of two 1 MiB-plus buckets: one trains 6 steps; another trains 3, then a
new DDP over the same module (with the optimizer's state) trains 3 more. Rank 0 writes
``identical True|False`` and, per DDP, its layout buckets reduced without a copy, those reduced
through a gathered buffer, and the layout's bucket count.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist

from unbroken.train._reduction import fix_reduction_layout

WIDTH = 600  # two Linear(600, 600) layers: 1.44 MB each, so DDP's rebuild makes two buckets


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, WIDTH),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.ReLU(),
        torch.nn.Linear(WIDTH, 50),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def wrap(m: torch.nn.Module) -> Any:
        ddp = torch.nn.parallel.DistributedDataParallel(m)
        if not a.plain:
            assert fix_reduction_layout(ddp) is None
        return ddp

    saved: dict[str, Any] = {}

    def train(m: torch.nn.Module, ddp: Any, start: int, steps: int) -> None:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        if start:
            opt.load_state_dict(saved["opt"])
        for step in range(start, start + steps):
            g = torch.Generator().manual_seed(step * 10 + rank)
            x = torch.randint(0, 50, (16,), generator=g)
            torch.nn.functional.cross_entropy(ddp(x), x).backward()
            opt.step()
            opt.zero_grad()
        saved["opt"] = opt.state_dict()

    m1 = model()
    d1 = wrap(m1)
    train(m1, d1, 0, 6)
    m2 = model()
    d2 = wrap(m2)
    train(m2, d2, 0, 3)
    d3 = wrap(m2)  # the resume: a new DDP over the same module
    train(m2, d3, 3, 3)
    same = all(torch.equal(x, y) for x, y in zip(m1.parameters(), m2.parameters(), strict=True))
    if rank == 0:
        counts = []
        for d in (d1, d2, d3):
            r = getattr(d, "_unbroken_reduction", None)
            counts.append("0,0,0" if r is None else f"{r.zero_copy},{r.gathered},{len(r.layout)}")
        with open(a.out, "w") as f:
            f.write(f"identical {same} {' '.join(counts)}\n")
    dist.barrier()
    # The ranks are done: leave without gloo's teardown (it may abort a finished rank).
    os._exit(0)


if __name__ == "__main__":
    main()
