"""A crash loses at most one step under the defaults (issue 47): no snapshot setting given.

``unbroken run`` over a trainer that sets nothing about snapshots (``snapshot_every`` left to
its default) and saves durably only far apart (``--save-every 1000``); the trainer is
SIGKILLed from outside at steps it has logged (a real second process). Every relaunch must
resume from an in-memory snapshot (the supervisor says it kept one; no durable checkpoint is
that recent) at most one step behind the last step the killed trainer logged, and the run must
end bitwise equal to an uninterrupted one: every tensor (``torch.equal``), all JSON state and
the full per-step log, losses included.
"""

from __future__ import annotations

import os
import re
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
)

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"
STEPS = 24
ARGS = ["--steps", str(STEPS), "--save-every", "1000", "--workers", "0"]


@pytest.mark.slow
def test_kill_9_under_the_defaults_redoes_at_most_one_step(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(ref)]) == 0
    moments = [4, 11, 18]  # before the interval is chosen (step 6), and after
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "unbroken", "run", "--max-retries", "10", "--backoff", "0"]
    # 200 ms steps (a sleep): the time a step of real work takes, so the default interval is
    # judged against a step that a snapshot can hide in, as on a real run.
    cmd += ["--", sys.executable, str(SCRIPT), *ARGS, "--run-dir", str(run), "--step-sleep", "0.2"]
    text, reached, _ = supervise_and_kill(cmd, run, moments, env, wait=180)
    # The default chose a snapshot every step (said once per trainer that got that far).
    chosen = re.findall(r"in-memory snapshot every (\d+) step", text)
    assert chosen and set(chosen) == {"1"}, (chosen, text[-3000:])
    kept = [int(s) for s in re.findall(r"kept the in-memory snapshot of step (\d+)", text)]
    assert_resumed_within_a_step(run, reached, text)
    # Each relaunch resumed from a snapshot the supervisor kept (it says so twice: when it
    # keeps it and in the attempt's summary).
    assert sorted(set(kept)) == resume_steps(run), (kept, resume_steps(run))
    assert_identical(ref, run)
