"""Lightning with a validation loader of persistent workers, stopped by a tree-wide signal.

tests/scripts/lightning_val.py: unbroken's train loader (2 workers) and a plain torch validation
loader (2 persistent workers) that Lightning runs every 4 steps; ``ValLog`` (a stateful
callback, tracked) keeps each validation's (step, val_loss).

The signal goes to every process of the tree after step 7 -- the validation workers started at
step 4 are alive -- and the stop saves step 8, the step whose validation is due: the relaunch
must run that validation first (exactly once across the resume), and must not draw from the
global random stream when it creates the validation iterator again (its persistent workers
start once per process); the final weights, optimizer, every callback's state and the losses
must equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

from tests.golden import ROOT, assert_identical, launch  # noqa: E402
from unbroken import EXIT_RESUMABLE  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "lightning_val.py"
INTERRUPT = ROOT / "tests" / "scripts" / "interrupt.py"
ARGS = ["--val-persistent", "--steps", "12", "--save-every", "5", "--val-every", "4"]


def test_persistent_validation_workers_survive_a_tree_wide_stop_and_resume_exactly(
    tmp_path: Path,
) -> None:
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(reference)]) == 0
    code = launch(
        INTERRUPT,
        [str(SCRIPT), *ARGS, "--run-dir", str(run_dir)]
        + ["--signal-at", "7", "--signal", "INT", "--signal-tree"],
    )
    assert code == EXIT_RESUMABLE
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(run_dir)]) == 0
    seen = json.loads((run_dir / "val.json").read_text())
    assert [step for step, _ in seen] == [4, 8, 12], seen  # step 8's validation ran once
    assert seen == json.loads((reference / "val.json").read_text())
    assert_identical(reference, run_dir)
