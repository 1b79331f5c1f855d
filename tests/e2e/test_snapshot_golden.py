"""Lose at most one step to a crash: in-memory snapshots kept by the supervisor (issue 16).

A trainer under ``unbroken run`` with durable saves far apart (``--save-every 1000``) and a
snapshot every step is SIGKILLed at moments drawn by the test (a real second process, killed
from outside while it trains); the supervisor persists the newest snapshot and relaunches.
Every relaunch must resume at most one step behind the last step the killed trainer logged,
and the run must end bitwise equal to an uninterrupted one, with each step logged once.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.golden import (
    ROOT,
    assert_identical,
    assert_resumed_within_a_step,
    launch,
    resume_steps,
    supervise_and_kill,
    tree_report,
)

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"
STEPS = 30
ARGS = ["--steps", str(STEPS), "--save-every", "1000", "--workers", "0"]


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_at_most_one_step(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(ref)]) == 0
    rng = random.Random(int(os.environ.get("UNBROKEN_TEST_SEED", "16")))
    moments = sorted(rng.sample(range(3, STEPS - 2), 5))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "unbroken", "run", "--max-retries", "10", "--backoff", "0"]
    cmd += ["--", sys.executable, str(SCRIPT), *ARGS, "--run-dir", str(run)]
    cmd += ["--step-sleep", "0.05", "--snapshot-every", "1"]
    text, reached, sup_pid = supervise_and_kill(cmd, run, moments, env, wait=120)
    assert_resumed_within_a_step(run, reached, text)
    assert_identical(ref, run)
    private = f"/dev/shm/unbroken-{os.getuid()}"
    mine = [n for n in os.listdir(private) if n.startswith(f"sup-{sup_pid}-")]
    assert not mine, mine  # the area and its channel are removed when the supervisor exits


@pytest.mark.slow
def test_two_ranks_under_torchrun_lose_at_most_one_step(tmp_path: Path) -> None:
    """``unbroken run -- torchrun --nproc_per_node 2``: one snapshot area for the node, both
    ranks' parts committed together; rank 1 is SIGKILLed (by itself, at step 7 of the first
    attempt), torchrun fails the job, the supervisor keeps the snapshot and relaunches."""
    script = ROOT / "tests" / "scripts" / "toy_dist.py"
    args = ["--steps", "12", "--save-every", "1000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc_per_node", "2"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run(
        [*torchrun, str(script), *args, "--run-dir", str(ref)],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    cmd = [sys.executable, "-m", "unbroken", "run", "--backoff", "0", "--", *torchrun]
    cmd += [str(script), *args, "--run-dir", str(run), "--snapshot-every", "1"]
    # (--signal is left at its default, KILL: torchrun would take it for --signals-to-handle)
    cmd += ["--signal-at", "7", "--signal-rank", "1", "--signal-attempt", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        tree = tree_report(proc.pid)  # where it hangs, before its end is pulled down
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"hung for 400 s:\n{tree}\n{(out + err)[-5000:]}") from None
    assert proc.returncode == 0, (out + err)[-5000:]
    assert "kept the in-memory snapshot of step" in err, err[-3000:]
    resumes = resume_steps(run)
    assert len(resumes) == 1 and 6 <= resumes[0] <= 7, resumes  # at most one step behind 7
    assert_identical(ref, run)
