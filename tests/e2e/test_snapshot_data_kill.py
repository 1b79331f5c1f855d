"""Parameters changed through ``.data`` between ``run.step()`` and the next optimizer step
(issue 47's hole): SIGKILL after in-memory snapshots, the resumed run equals the uninterrupted
one bit for bit, with ``snapshot_copy="background"`` (the opt-in that watches ``.data``).

``p.data`` is a tensor of its own with its own version counter: a change through it (WGAN's
weight clipping, ``p.data.clamp_(-c, c)`` before each forward) does not show in ``p``'s
counter, which the snapshot's background copy checks. The trainer changes every parameter
through ``.data`` at the start of each step, then sleeps there, in the window where the
snapshot's thread copies the parameters; it is SIGKILLed from outside at steps it has logged,
and every relaunch resumes from a snapshot. ``scale`` (``p.data.mul_``) is not idempotent: a
snapshot holding the change of step N+1 resumes with it applied twice. ``clamp`` is the real
case (idempotent, so a copy taken after the clamp resumes right by luck; kept as the case
users have). Each run ends compared with an uninterrupted one: every tensor (``torch.equal``),
all JSON state and the full per-step log, losses included.
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
    supervise_and_kill,
)

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"
STEPS = 20
ARGS = ["--steps", str(STEPS), "--save-every", "1000", "--workers", "0", "--snapshot-every", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("meddle", ["scale", "clamp"])
def test_kill_9_with_parameters_changed_through_data(tmp_path: Path, meddle: str) -> None:
    """The opt-in background copy: the watch of ``.data`` sees the change."""
    _kill_and_compare(tmp_path, [*ARGS, "--meddle", meddle, "--snapshot-copy", "background"])


@pytest.mark.slow
def test_kill_9_with_parameters_scaled_through_data_under_the_default_copy(
    tmp_path: Path,
) -> None:
    """The default (every tensor copied in the step): exact with no watch at all -- torch is
    not patched in the trainer (it says so after every step), and no snapshot is dropped."""
    text = _kill_and_compare(tmp_path, [*ARGS, "--meddle", "scale", "--say-watch"])
    said = re.findall(r"Tensor\.data patched: (\w+)", text)
    assert said and set(said) == {"False"}, text[-3000:]
    assert "was not kept" not in text, text[-3000:]
    assert "copied in the background" not in text, text[-3000:]


def _kill_and_compare(tmp_path: Path, args: list[str]) -> str:
    """SIGKILL the trainer at three steps it logged; each relaunch resumes from a snapshot at
    most one step behind; the run ends equal to an uninterrupted one. The supervisor's output."""
    ref = tmp_path / "ref"
    assert launch(SCRIPT, [*args, "--run-dir", str(ref)]) == 0
    moments = [4, 9, 14]
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "unbroken", "run", "--max-retries", "10", "--backoff", "0"]
    cmd += ["--", sys.executable, str(SCRIPT), *args, "--run-dir", str(run)]
    cmd += ["--step-sleep", "0.05"]
    text, reached, _ = supervise_and_kill(cmd, run, moments, env, wait=180)
    assert_resumed_within_a_step(run, reached, text)
    assert_identical(ref, run)
    return text
