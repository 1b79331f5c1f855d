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
import random
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

from tests.golden import (  # noqa: E402
    ROOT,
    assert_identical,
    launch,
    resume_steps,
    run_interrupted,
)
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


# ---- a stop anywhere in a validation period, with gradient accumulation --------------------

# Validation every 6 batches = every 3 optimizer steps (accumulation 2), bf16-mixed on the CPU,
# 2 train-loader workers; an epoch is 8 batches (4 steps): validations at steps 3, 6, 9, 12,
# epoch ends at 4, 8, 12. The only periodic save is step 7, so each stop below saves its own.
ACCUM = [
    *("--steps", "12", "--save-every", "7", "--val-every", "6", "--accumulate", "2"),
    *("--precision", "bf16-mixed", "--epoch-samples", "64"),
]


@pytest.fixture(scope="module")
def accum_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ref = tmp_path_factory.mktemp("lightning-accum-ref")
    assert launch(SCRIPT, [*ACCUM, "--run-dir", str(ref)]) == 0
    assert [step for step, _ in json.loads((ref / "val.json").read_text())] == [3, 6, 9, 12]
    return ref


# (global step, Lightning hook the SIGTERM lands in, the step the relaunch resumes at).
# In the first micro-batch of steps 4 (just after step 3's validation, the epoch's last step),
# 5 (the next epoch's first) and 6 (the step the validation is due at); after the last batch
# of step 6's validation. Each stop is saved at the end of the optimizer step in progress.
STOPS = [
    (3, "on_train_batch_start", 4),
    (4, "on_train_batch_start", 5),
    (5, "on_train_batch_start", 6),
    (6, "on_validation_end", 7),
]


@pytest.mark.parametrize(("at", "hook", "resumed"), STOPS, ids=[f"{h}@{s}" for s, h, _ in STOPS])
def test_sigterm_anywhere_in_a_validation_period_with_accumulation_resumes_exactly(
    accum_reference: Path, tmp_path: Path, at: int, hook: str, resumed: int
) -> None:
    run_dir = tmp_path / "run"
    code = launch(
        INTERRUPT,
        [str(SCRIPT), *ACCUM, "--run-dir", str(run_dir)]
        + ["--signal-at", str(at), "--signal", "TERM", "--signal-phase", f"lightning:{hook}"],
    )
    assert code == EXIT_RESUMABLE
    assert launch(SCRIPT, [*ACCUM, "--run-dir", str(run_dir)]) == 0
    steps = resume_steps(run_dir)
    assert len(steps) == 1 and steps[0] > 0, steps  # it resumed from the stop's checkpoint
    seen = json.loads((run_dir / "val.json").read_text())
    assert seen == json.loads((accum_reference / "val.json").read_text())  # each ran once
    assert_identical(accum_reference, run_dir)
    assert steps == [resumed]


def test_sigkill_after_a_checkpoint_with_accumulation_resumes_exactly(
    accum_reference: Path, tmp_path: Path
) -> None:
    at = random.Random(tmp_path.name).randint(8, 11)  # after the save of step 7
    run_dir = tmp_path / "run"
    run_interrupted(INTERRUPT, [str(SCRIPT), *ACCUM], run_dir, [(at, "KILL")])
    assert resume_steps(run_dir) == [7], f"killed after step {at}"
    assert_identical(accum_reference, run_dir)
