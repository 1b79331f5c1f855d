"""On 2 gloo ranks, what CanonicalGradients refuses: K not divisible by the world size, FSDP2.

Prints one line per refusal (the ConfigError's text) and exits 0 when both were refused.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import unbroken


def main() -> None:
    _, world = unbroken.init_distributed()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    try:
        unbroken.train.CanonicalGradients(model, 3)
    except unbroken.ConfigError as e:
        print("refused:", e, file=sys.stderr, flush=True)
    else:
        raise SystemExit(f"3 shards were accepted on {world} ranks")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    try:
        unbroken.train.CanonicalGradients(model, 2)
    except unbroken.ConfigError as e:
        print("refused:", e, file=sys.stderr, flush=True)
    else:
        raise SystemExit("an FSDP2 model was accepted")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
