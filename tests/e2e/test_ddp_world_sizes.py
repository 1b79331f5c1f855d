"""Bit for bit at the world sizes real jobs use: 3 and 4 ranks (gloo on CPU).

A new DistributedDataParallel reduces its first backward in one flat bucket, then in buckets
rebuilt in the order the gradients arrived. A resumed process is a new DDP: without
unbroken's fixed reduction layout (train/_reduction.py) its first step adds the ranks' gradients
in another order than the uninterrupted run's same step, and at 3 ranks or more the run drifts
by the last bit from there (at 2 ranks a + b = b + a hides it).

Each case: an uninterrupted run against one SIGKILLed at a drawn logged step after the first
checkpoint, relaunched, SIGTERMed (exit 75) at a later drawn step, relaunched to the end; each
relaunch a fresh set of processes that must resume from a checkpoint; every tensor compared
with ``torch.equal`` and every logged step. ``UNBROKEN_TEST_SEED`` redraws the stops;
``scripts/ddp_world_sizes.py`` runs many draws at 2..6 ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_launch import launch
from tests.golden import ROOT, assert_identical, draw_stops, resume_steps

TOY = ROOT / "tests" / "scripts" / "toy_dist.py"
LAYOUT = ROOT / "tests" / "scripts" / "ddp_layout.py"
STEPS, SAVE_EVERY = 14, 4
VARIANTS = {
    "ddp": ["--mode", "ddp"],
    "ddp-no_sync": ["--mode", "ddp", "--accumulate", "2"],
    "ddp-bf16": ["--mode", "ddp", "--bf16"],
    "fsdp2": ["--mode", "fsdp"],
}
_references: dict[tuple[int, str], Path] = {}


def _args(variant: str, world: int = 3) -> list[str]:
    # Width 64 and a global batch of 24 (8 per rank at 5 ranks and more): enough gradient
    # elements that a different reduction order shows.
    batch = 24 if 24 % world == 0 else 8 * world
    return [
        *VARIANTS[variant],
        *("--steps", str(STEPS), "--save-every", str(SAVE_EVERY)),
        *("--width", "64", "--batch-size", str(batch), "--n", str(6 * batch)),
    ]


def _reference(world: int, variant: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    key = (world, variant)
    if key not in _references:
        ref = tmp_path_factory.mktemp(f"ref-{world}-{variant}")
        codes, _ = launch(TOY, ["--run-dir", str(ref), *_args(variant, world)], world)
        assert codes == [0] * world
        _references[key] = ref
    return _references[key]


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kill_and_stop_resume_bit_for_bit(
    world: int, variant: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref = _reference(world, variant, tmp_path_factory)
    seed = f"{os.environ.get('UNBROKEN_TEST_SEED', '45')}-{world}-{variant}"
    kill, term = draw_stops(seed, STEPS, SAVE_EVERY)
    cut = tmp_path / "cut"
    args = ["--run-dir", str(cut), *_args(variant, world)]
    codes, _ = launch(TOY, [*args, "--signal-at", str(kill), "--signal", "KILL"], world)
    assert codes == [-9] * world
    codes, _ = launch(TOY, [*args, "--signal-at", str(term), "--signal", "TERM"], world)
    assert codes == [75] * world
    codes, _ = launch(TOY, args, world)
    assert codes == [0] * world
    # Each relaunch resumed from a checkpoint: the last save before the kill, then the stop's
    # (the SIGTERM after step K is honoured, and saved, at the end of step K + 1).
    assert resume_steps(cut) == [kill // SAVE_EVERY * SAVE_EVERY, term + 1], (seed, kill, term)
    assert_identical(ref, cut)


def test_a_new_ddp_reduces_like_the_one_it_replaces(tmp_path: Path) -> None:
    """The mechanism in plain torch: a DDP built mid-run (as a resume builds one) ends equal to
    one that ran throughout, at 3 ranks, with two buckets (a 1 MiB first bucket, as DDP makes);
    and every step after a process's first reduces in DDP's own buffer, no copy. The last
    check fails loudly if torch changes how DDP rebuilds its buckets (train/_reduction.py
    computes the same layout; the result stays exact, a step costs a copy more)."""
    codes, errs = launch(LAYOUT, ["--out", str(tmp_path / "report")], 3)
    assert codes == [0, 0, 0], errs
    report = (tmp_path / "report").read_text().split()
    assert report[:2] == ["identical", "True"], report
    # zero-copy and gathered layout-bucket reductions of the three DDPs, and the layout's size
    throughout, first_half, second_half = (tuple(map(int, r.split(","))) for r in report[2:5])
    assert throughout == (2 * 5, 2, 2), report  # 6 steps of 2 layout buckets: step 1 gathered
    assert first_half == second_half == (2 * 2, 2, 2), report
    # Without the fixed layout the same DDPs differ: what the test above guards against.
    codes, errs = launch(LAYOUT, ["--out", str(tmp_path / "plain"), "--plain"], 3)
    assert codes == [0, 0, 0], errs
    assert (tmp_path / "plain").read_text().split()[:2] == ["identical", "False"]


_STANDS_ASIDE = """
import tempfile, warnings, torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from unbroken.train._reduction import fix_layouts, fix_reduction_layout
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp()), rank=0, world_size=1)
DDP = torch.nn.parallel.DistributedDataParallel
sparse = DDP(torch.nn.Sequential(torch.nn.Embedding(9, 4, sparse=True), torch.nn.Linear(4, 1)))
hooked = DDP(torch.nn.Linear(4, 1))
hooked.register_comm_hook(None, default_hooks.allreduce_hook)
unused = DDP(torch.nn.Linear(4, 1), find_unused_parameters=True)
plain = DDP(torch.nn.Linear(4, 1))
print("sparse:", fix_reduction_layout(sparse))
print("hooked:", fix_reduction_layout(hooked))
print("unused:", fix_reduction_layout(unused), getattr(unused, "_unbroken_reduction", None))
print("plain:", fix_reduction_layout(plain), type(plain._unbroken_reduction).__name__)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    fix_layouts([hooked])
print("warned:", [type(x.message).__name__ for x in w])
"""


def test_what_it_cannot_fix_is_named_and_left_as_it_is() -> None:
    """A hook of the user's or a sparse embedding: the layout is left to DDP and the reason
    named (a ResumeWarning from Run()); find_unused_parameters=True needs nothing (DDP never
    rebuilds then)."""
    out = subprocess.run(
        [sys.executable, "-c", _STANDS_ASIDE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert "sparse embedding" in lines["sparse"] and "not bit for bit" in lines["sparse"]
    assert "communication hook of its own" in lines["hooked"]
    assert lines["unused"] == "None None"
    assert lines["plain"] == "None _FixedLayout"
    assert lines["warned"] == "['ResumeWarning']"
