"""A completed run asked for more steps continues, and says so (issue 17, finding 5).

Found from outside: raising ``--steps`` on a completed run directory did nothing and said
nothing. Real processes: the toy trainer finishes 6 steps, then is relaunched with 10.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.golden import ROOT
from unbroken import read_metrics
from unbroken.store import CheckpointStore

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"


def _train(run: Path, steps: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", str(steps), "--save-every", "3"]
        + ["--run-dir", str(run)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_raising_the_steps_of_a_completed_run_continues_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert _train(run, 6).returncode == 0
    same = _train(run, 6)  # the same command again: nothing to do, and nothing is said
    assert same.returncode == 0 and "continuing" not in same.stderr
    assert [r["step"] for r in read_metrics(str(run))] == list(range(1, 7))
    more = _train(run, 10)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "was complete at step 6; continuing it to max_steps=10" in more.stderr, more.stderr
    assert [r["step"] for r in read_metrics(str(run))] == list(range(1, 11))
    final = CheckpointStore(str(run)).latest()
    assert final is not None and final.step == 10
