"""The chain sum of canonical micro-shards against the contract written out in one process.

tests/scripts/canonical_grads.py computes the reference -- every shard's gradient by plain
backward calls, added in shard order -- on each rank and requires ``CanonicalGradients`` to give
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
    ("shards", "worlds", "bucket", "single"),
    [
        (4, (1, 2, 4), "7", False),  # two backward() calls a shard: summed after each shard
        (4, (1, 2, 4), "7", True),  # one call: the last shard's backward sends buckets
        (6, (3,), "50", True),
        (8, (2,), None, True),  # the default bucket size
    ],
)
def test_every_world_size_gives_the_reference_bits(
    tmp_path: Path, shards: int, worlds: tuple[int, ...], bucket: str | None, single: bool
) -> None:
    outs = []
    for world in worlds:
        out = tmp_path / f"w{world}.safetensors"
        args = ["--shards", str(shards), "--out", str(out)]
        args += ["--bucket", bucket] if bucket else []
        args += ["--single"] if single else []
        assert launch(SCRIPT, args, world, allowed=(0,))[0] == [0] * world
        outs.append(load_file(str(out)))
    for other in outs[1:]:
        assert other.keys() == outs[0].keys()
        assert all(torch.equal(other[k], outs[0][k]) for k in outs[0])
