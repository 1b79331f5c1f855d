"""The chain sum of canonical micro-shards against the contract written out in one process.

tests/scripts/canonical_grads.py computes the reference -- every shard's gradient by plain
backward calls, added in shard order -- on each rank and requires ``CanonicalShards`` to give
it bit for bit (sign of zero included) on W ranks: rank 0 at the head of the chain, middle
ranks, the last rank that broadcasts, buckets cutting parameters and dtype boundaries.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.dist_launch import launch
from tests.golden import ROOT

SCRIPT = ROOT / "tests" / "scripts" / "canonical_grads.py"


@pytest.mark.parametrize(
    ("shards", "worlds", "bucket"),
    [(4, (1, 2, 4), "7"), (6, (3,), "50"), (8, (2,), None)],
)
def test_every_world_size_gives_the_reference_bits(
    tmp_path: Path, shards: int, worlds: tuple[int, ...], bucket: str | None
) -> None:
    outs = []
    for world in worlds:
        out = tmp_path / f"w{world}.safetensors"
        args = ["--shards", str(shards), "--out", str(out)]
        args += ["--bucket", bucket] if bucket else []
        assert launch(SCRIPT, args, world, allowed=(0,))[0] == [0] * world
        outs.append(load_file(str(out)))
    for other in outs[1:]:
        assert other.keys() == outs[0].keys()
        assert all(torch.equal(other[k], outs[0][k]) for k in outs[0])
