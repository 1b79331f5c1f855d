"""The metrics log after a ``kill -9``: its steps held in memory are lost, but only steps
after the last checkpoint, which the resume redoes -- every step's loss is in the log exactly
once, as in the uninterrupted run; and a script that ends without closing its run still
leaves every logged step in the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.golden import ROOT, launch
from unbroken import read_metrics

TOY = ROOT / "tests" / "scripts" / "toy_train.py"
ARGS = ["--steps", "14", "--save-every", "4"]
# toy_train.py with the metrics log written only when it must be (before a save, at an event):
# the steps a kill -9 ends are then certainly in memory only.
HELD = Path(__file__).with_name("_held_metrics.py")


def test_kill_9_then_resume_keeps_every_steps_loss_exactly_once(tmp_path):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert launch(TOY, [*ARGS, "--run-dir", str(ref)]) == 0
    # Killed at step 7 (saved 4) and at 13 (saved 12): steps 5-7 and 13 lived in memory only.
    assert launch(HELD, [*ARGS, "--run-dir", str(cut), "--signal-at", "7"]) == -9
    assert [r["step"] for r in read_metrics(cut)] == [1, 2, 3, 4]
    assert launch(HELD, [*ARGS, "--run-dir", str(cut), "--signal-at", "13"]) == -9
    assert [r["step"] for r in read_metrics(cut)] == list(range(1, 13))
    assert launch(TOY, [*ARGS, "--run-dir", str(cut)]) == 0
    want = read_metrics(ref)
    assert [r["step"] for r in want] == list(range(1, 15))
    assert read_metrics(cut) == want  # every step once, same loss bits (JSON floats round-trip)


SCRIPT = """
import sys, torch, unbroken
model = torch.nn.Linear(2, 1)
run = unbroken.Run(sys.argv[1], model=model, save_final=False, progress=False)
for i in range(5):
    run.step(loss=torch.tensor(float(i)))
if sys.argv[2] == "raise":
    raise RuntimeError("the script fails without closing its run")
"""


def test_a_script_ending_without_closing_its_run_leaves_every_step(tmp_path):
    for how in ("return", "raise"):
        run_dir = tmp_path / how
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(run_dir), how],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == (0 if how == "return" else 1), proc.stderr
        assert [r["loss"] for r in read_metrics(run_dir)] == [0.0, 1.0, 2.0, 3.0, 4.0]
