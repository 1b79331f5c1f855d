"""Ranks of a gloo group run unbroken's bounded collectives; ``--absent R`` makes rank R skip
them (it sleeps, then exits 0), so the others must time out naming it."""

from __future__ import annotations

import argparse
import sys
import time

import torch.distributed as dist

from unbroken import _dist
from unbroken.errors import CollectiveTimeoutError

p = argparse.ArgumentParser()
p.add_argument("--run-dir", required=True)
p.add_argument("--absent", type=int, default=-1)
p.add_argument("--timeout", type=float, default=2.0)
a = p.parse_args()
dist.init_process_group("gloo")
# As Run() does: a gloo group left alive into interpreter teardown can abort the process (-6).
_dist.clean_exit()
rank = dist.get_rank()
_dist.set_report_dir(a.run_dir)
_dist.set_timeout(a.timeout)
_dist.GRACE = 3.0
if rank == a.absent:
    time.sleep(a.timeout + _dist.GRACE + 2)
    sys.exit(0)
try:
    assert _dist.any_true(rank == 1, what="commit verdict") is True
    world = dist.get_world_size()
    assert _dist.sum_floats([float(rank), 1.0]) == [float(sum(range(world))), float(world)]
    assert _dist.broadcast_object({"step": 7} if rank == 0 else None) == {"step": 7}
    assert _dist.broadcast_object(False) is False
    _dist.barrier()
    print(f"rank {rank}: ok", flush=True)
except CollectiveTimeoutError as e:
    print(f"rank {rank}: timeout missing={e.missing}: {e}", file=sys.stderr, flush=True)
    sys.exit(3)
