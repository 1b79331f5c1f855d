"""Golden resume tests of every data source, through examples/streaming_lm.py.

Each interrupted run is a chain of separate processes stopped by SIGKILL or SIGTERM right after a
step (tests/scripts/interrupt.py) and relaunched from fresh objects -- with another
``--num-workers``, or another number of ranks -- and then compared with an uninterrupted run:
``torch.equal`` on every tensor, all JSON state, and the per-step log, which holds the global ids
of every step's samples.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.dist_launch import launch as launch_ranks
from tests.golden import (
    ROOT,
    assert_identical,
    check_resumed,
    expected_code,
    has_checkpoint,
    launch,
)
from unbroken import read_metrics

EXAMPLE = ROOT / "examples" / "streaming_lm.py"
INTERRUPT = ROOT / "tests" / "scripts" / "interrupt.py"
KILLED = -9


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four shards of 7..10 records: an epoch is ~6 steps of 6, so runs cross epochs."""
    d = tmp_path_factory.mktemp("shards")
    rng = random.Random(7)
    words = ["the", "red", "house", "of", "a", "dog", "runs", "fast", "and", "slow", "sun"]
    for k in range(4):
        with open(d / f"part-{k}.jsonl", "w", encoding="utf-8") as f:
            for i in range(7 + k):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
                f.write(json.dumps({"id": 100 * k + i, "text": text}) + "\n")
    return d


def _args(shards: Path, source: str, workers: int, steps: int = 10) -> list[str]:
    return [
        *("--data-dir", str(shards), "--source", source, "--steps", str(steps)),
        *("--save-every", "3", "--batch-size", "6", "--context", "16"),
        *("--num-workers", str(workers), "--hf-shards", "4"),
    ]


def _cut(run_dir: Path, shards: Path, source: str, chain: list[tuple[int, str, int]], last: int):
    """Stop after step k by signal s with w workers, for each (k, s, w); then finish with
    ``last`` workers."""
    resumed = False
    for step, sig, workers in chain:
        args = [str(EXAMPLE), *_args(shards, source, workers), "--run-dir", str(run_dir)]
        had = has_checkpoint(run_dir)
        code = launch(INTERRUPT, [*args, "--signal-at", str(step), "--signal", sig])
        assert code == expected_code(sig), f"{source}: stop at {step} by {sig}: exit {code}"
        resumed |= had and check_resumed(run_dir, f"the launch stopped at {step}")
    had = has_checkpoint(run_dir)
    assert launch(EXAMPLE, [*_args(shards, source, last), "--run-dir", str(run_dir)]) == 0
    resumed |= had and check_resumed(run_dir, "the final launch")
    assert resumed, f"{source}: no relaunch resumed from a checkpoint: {chain}"


def _reference(tmp_path: Path, shards: Path, source: str) -> Path:
    ref = tmp_path / "ref"
    assert launch(EXAMPLE, [*_args(shards, source, 0), "--run-dir", str(ref)]) == 0
    return ref


def _samples(run_dir: Path) -> list[list[int]]:
    return [m["samples"] for m in read_metrics(str(run_dir))]


def test_jsonl_shards_resume_bitwise_with_0_and_2_workers(tmp_path: Path, shards: Path) -> None:
    ref = _reference(tmp_path, shards, "jsonl")
    cut = tmp_path / "cut"
    # Killed with 2 workers, stopped by SIGTERM with none, finished with 2 again.
    _cut(cut, shards, "jsonl", [(4, "KILL", 2), (8, "TERM", 0)], last=2)
    assert_identical(ref, cut)
    steps = _samples(ref)
    assert len(steps) == 10 and all(len(s) == 6 or len(s) < 6 for s in steps)
    assert len({i for s in steps[:5] for i in s}) == sum(len(s) for s in steps[:5])  # epoch 0
    assert (cut / "final.safetensors").is_file() and (cut / "trace.jsonl").is_file()


@pytest.mark.parametrize(
    ("source", "chain", "last"),
    [
        ("hf", [(3, "KILL", 2), (7, "TERM", 0)], 0),
        ("hf-iterable", [(3, "TERM", 2), (7, "KILL", 0)], 2),
        ("sampler", [(3, "KILL", 0), (7, "TERM", 2)], 0),
    ],
)
def test_other_sources_resume_bitwise(
    tmp_path: Path, shards: Path, source: str, chain: list[tuple[int, str, int]], last: int
) -> None:
    ref = _reference(tmp_path, shards, source)
    cut = tmp_path / "cut"
    _cut(cut, shards, source, chain, last)
    assert_identical(ref, cut)
    ids = _samples(ref)
    assert len(ids) == 10 and all(ids)


def _ranks(run_dir: Path, shards: Path, world: int, *extra: str) -> list[int]:
    args = [str(EXAMPLE), *_args(shards, "jsonl", 0), "--run-dir", str(run_dir), *extra]
    return launch_ranks(INTERRUPT, args, world)[0]


def test_two_ranks_resume_on_one_and_on_three(tmp_path: Path, shards: Path) -> None:
    """The global sample-id sequence of an uninterrupted 2-rank run, when the run is stopped at
    2 ranks and finished at 1, or killed at 2 and finished at 3 (gloo, CPU)."""
    ref = tmp_path / "ref"
    assert _ranks(ref, shards, 2) == [0, 0]
    want = _samples(ref)
    assert len(want) == 10 and sorted(sum(want[:6], [])) == list(range(34))  # epoch 0: 34

    one = tmp_path / "one"
    assert _ranks(one, shards, 2, "--signal-at", "4", "--signal", "TERM") == [75, 75]
    assert _ranks(one, shards, 1) == [0]
    assert _samples(one) == want

    three = tmp_path / "three"
    assert _ranks(three, shards, 2, "--signal-at", "5", "--signal", "KILL") == [KILLED, KILLED]
    assert _ranks(three, shards, 3) == [0, 0, 0]
    assert _samples(three) == want
