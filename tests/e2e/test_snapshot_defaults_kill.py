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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import ROOT, assert_identical, launch, logged_steps, resume_steps, trainers

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
    sup = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reached: list[int] = []
    child = None
    try:
        for at in moments:
            # Past the last step the previous trainer logged (see test_snapshot_golden.py).
            target = max(at, reached[-1] + 2) if reached else at
            deadline = time.monotonic() + 180
            while True:
                if time.monotonic() > deadline or sup.poll() is not None:
                    raise AssertionError(f"the trainer never reached step {target}")
                now = trainers(sup.pid)
                steps = logged_steps(run)
                if steps and steps[-1] >= target and len(now) == 1 and now[0] != child:
                    break
                time.sleep(0.01)
            (child,) = now
            os.kill(child, signal.SIGKILL)
            while os.path.exists(f"/proc/{child}") and trainers(sup.pid) == [child]:
                time.sleep(0.005)
            reached.append(logged_steps(run)[-1])
        out, _ = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
    text = out.decode(errors="replace")
    assert sup.returncode == 0, text[-4000:]
    # The default chose a snapshot every step (said once per trainer that got that far).
    chosen = re.findall(r"in-memory snapshot every (\d+) step", text)
    assert chosen and set(chosen) == {"1"}, (chosen, text[-3000:])
    kept = [int(s) for s in re.findall(r"kept the in-memory snapshot of step (\d+)", text)]
    resumes = resume_steps(run)
    assert len(resumes) == len(moments), (resumes, reached, text[-3000:])
    # Each relaunch resumed from a snapshot the supervisor kept (it says so twice: when it
    # keeps it and in the attempt's summary).
    assert sorted(set(kept)) == resumes, (kept, resumes)
    for last, resumed in zip(reached, resumes, strict=True):
        assert last - 1 <= resumed <= last, (reached, resumes)
    assert_identical(ref, run)
