"""``kill -9`` of ``unbroken run`` itself: its trainer must stop as on a preemption, not train on.

Found in round one and left open until now: the supervised command kept running as an orphan,
holding the run's lock, so the next ``unbroken run`` could not start. The supervisor now gives
its child a death signal (``PR_SET_PDEATHSIG`` = SIGTERM): the trainer saves the step it is on
and exits 75, and a new ``unbroken run`` resumes it -- bitwise equal to an uninterrupted run.
Real processes throughout: the supervisor is SIGKILLed from here while its trainer trains.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import ROOT, assert_identical, launch, trainers
from unbroken import read_metrics

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"
ARGS = ["--steps", "24", "--save-every", "1000", "--workers", "0", "--snapshot-every", "0"]


def _supervised(run: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "unbroken", "run", "--max-retries", "0", "--"]
    return cmd + [sys.executable, str(SCRIPT), *ARGS, "--run-dir", str(run), *extra]


def _logged(run: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(str(run))]
    except (OSError, ValueError):
        return []


@pytest.mark.slow
def test_kill_9_of_the_supervisor_stops_its_trainer_with_a_save(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(ref)]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sup = subprocess.Popen(
        _supervised(run, "--step-sleep", "0.1"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not _logged(run) or _logged(run)[-1] < 5):
            time.sleep(0.05)
        (trainer,) = trainers(sup.pid)
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(timeout=30)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{trainer}") and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = os.path.exists(f"/proc/{trainer}")
        if alive:
            os.kill(trainer, signal.SIGKILL)
        assert not alive, "the trainer outlived its supervisor"
    finally:
        if sup.poll() is None:
            sup.kill()
    stopped_at = _logged(run)[-1]
    assert stopped_at < 24, "the trainer trained on to the end after its supervisor died"
    events = read_metrics(str(run), events=True)
    assert any(e.get("event") == "stop" for e in events), events[-3:]
    ckpts = sorted(os.listdir(run / "checkpoints"))
    assert ckpts == [f"step-{stopped_at:09d}"], ckpts  # the stop's save, nothing else
    # A new supervisor starts at once (the lock is free) and resumes the stop's checkpoint.
    again = subprocess.run(_supervised(run), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumes = [e["step"] for e in read_metrics(str(run), events=True) if e.get("event") == "resume"]
    assert resumes == [stopped_at]
    assert_identical(ref, run)
