"""Recovery under ``unbroken run`` never waits for nothing and never gives up on a run that
advances: real trainers, SIGKILLed from outside, with the supervisor's default options.

A crash that left the run at least two steps further than where its attempt began (a newer
durable checkpoint or a newer in-memory snapshot: one step is only the snapshot every process
takes of its first) is relaunched at once and starts a new count of crashes; only crashes in a
row *without* progress are retried with a backoff and, past --max-retries, given up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import ROOT, assert_identical, launch, logged_steps, trainers

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"
STEPS = 50  # ten kills, three steps or more apart
KILLS = 10  # the acceptance: ten kills in a row, each after some progress


def _kill_after_progress(sup: subprocess.Popen[bytes], run: Path, kills: int) -> list[int]:
    """SIGKILL the trainer ``kills`` times, each once it logged three steps past the step the
    previous one was killed at: it resumed at most there, and saved two steps past it (a step
    is committed before the next one is logged)."""
    reached: list[int] = []
    for _ in range(kills):
        target = (reached[-1] if reached else 0) + 3
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sup.poll() is None:
            steps = logged_steps(run)
            if steps and steps[-1] >= target:
                break
            time.sleep(0.01)
        else:
            out = sup.stdout.read().decode(errors="replace") if sup.stdout else ""
            raise AssertionError(f"the trainer never reached step {target}: {out[-3000:]}")
        (child,) = trainers(sup.pid)
        os.kill(child, signal.SIGKILL)
        while os.path.exists(f"/proc/{child}") and trainers(sup.pid) == [child]:
            time.sleep(0.005)
        reached.append(logged_steps(run)[-1])
    return reached


@pytest.mark.slow
@pytest.mark.parametrize(
    ("save_every", "supervisor"),
    [("1", []), ("1000", []), ("1", ["--no-snapshots"])],
    ids=["durable-each-step", "snapshots", "no-snapshots"],
)
def test_kills_after_progress_never_give_up_and_never_wait(
    tmp_path: Path, save_every: str, supervisor: list[str]
) -> None:
    """Ten kills in a row (more than the default --max-retries 3), each after progress, with
    the default --backoff: no wait before any relaunch, no giving up, bitwise equal at the end.
    ``durable-each-step``: the progress is a durable checkpoint (the snapshot of the same step
    is not newer, so nothing is persisted) -- it counts as progress all the same.
    ``no-snapshots``: no snapshot area at all; the supervisor still learns the run directory
    (from the launch's stop directory) and judges progress by its durable checkpoints."""
    args = ["--steps", str(STEPS), "--save-every", save_every, "--workers", "0"]
    ref = tmp_path / "ref"
    assert launch(SCRIPT, [*args, "--run-dir", str(ref)]) == 0
    run, report = tmp_path / "run", tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "unbroken", "run", "--json", str(report), *supervisor, "--"]
    cmd += [sys.executable, str(SCRIPT), *args, "--run-dir", str(run)]
    cmd += ["--step-sleep", "0.05", "--snapshot-every", "1"]
    sup = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        reached = _kill_after_progress(sup, run, KILLS)
        out, _ = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
    text = out.decode(errors="replace")
    assert sup.returncode == 0, (reached, text[-4000:])
    assert "gave up" not in text
    attempts = json.loads(report.read_text())["attempts"]
    crashes = [a for a in attempts if a["status"] == "crash"]
    assert len(crashes) == KILLS, attempts
    assert [a["backoff_s"] for a in crashes] == [0.0] * KILLS, attempts
    assert [a["crash"] for a in crashes] == [1] * KILLS, attempts  # each one starts a new count
    assert_identical(ref, run)


def test_the_persister_outlives_a_stop_signal_to_every_process_of_the_job(
    tmp_path: Path,
) -> None:
    """A scheduler signals every process of a job, the supervisor's persister too, at the very
    moment a crashed trainer may leave a snapshot to persist: the persister ignores stop
    signals (the supervisor decides, and closing its stdin ends it)."""
    from unbroken.supervise._persister import Persister

    p = Persister()
    p.start()
    assert p.proc is not None
    try:
        # Its handlers are in place once it answers a first request.
        assert p.persist(str(tmp_path / "no-area"), str(tmp_path / "run")) is None
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):
            os.kill(p.proc.pid, sig)
        assert p.persist(str(tmp_path / "no-area"), str(tmp_path / "run")) is None
        assert p.proc.poll() is None
    finally:
        p.close()
