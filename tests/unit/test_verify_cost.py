"""What makes `unbroken verify` cheap, in process: which commands are forked, the plan that
puts the kill during a save in the first launch, the schedule a Run tells, the report's line,
the comparison's findings as JSON (the forked comparison hands them back so)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from unbroken.process import _stops
from unbroken.verify import Comparison, Difference, VerifyReport, plan_interrupts
from unbroken.verify._findings import comparison_from_json, comparison_to_json
from unbroken.verify._forkserver import forkable
from unbroken.verify._report import Interruption
from unbroken.verify._volatile import NotCompared


@pytest.mark.parametrize(
    ("argv", "parsed"),
    [
        (["python", "train.py", "--a", "1"], ("train.py", False, ["--a", "1"])),
        (["/usr/bin/python3.11", "-u", "t.py"], ("t.py", False, [])),
        (["python3", "-m", "pkg.train", "--x"], ("pkg.train", True, ["--x"])),
        (["torchrun", "--nproc_per_node", "2", "t.py"], None),
        (["python", "-c", "print(1)"], None),
        (["python", "-X", "dev", "t.py"], None),  # an option a fork cannot honour
        (["python", "script.sh"], None),
        (["python"], None),
    ],
)
def test_which_commands_are_forked(argv: list[str], parsed: object) -> None:
    assert forkable(argv) == parsed


def test_the_kill_during_a_save_comes_first_where_there_is_room() -> None:
    saves = list(range(10, 61, 10))
    for seed in range(20):
        plan = plan_interrupts(3, seed, 60, saves)
        assert [t.kind for t in plan] == ["save", "step", "step"], plan
        assert plan[0].step in saves[1:]  # a checkpoint before it to resume from
        assert [t.signal for t in plan] == ["KILL", "KILL", "TERM"]
    # No room after any later save: the save kill goes where it fits, as before.
    assert [t.kind for t in plan_interrupts(3, 0, 8, [4, 8])] == ["step", "step", "save"]


def test_a_run_tells_its_schedule_to_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_stops.ENV, str(tmp_path))
    assert _stops.read_schedule(str(tmp_path)) is None
    _stops.tell_run_dir(str(tmp_path / "run"), {"max_steps": 60, "save_every": 10})
    told = json.loads((tmp_path / _stops.RUN_DIR_FILE).read_text())
    assert told["run_dir"] == str(tmp_path / "run")  # what the supervisor reads, unchanged
    assert _stops.read_schedule(str(tmp_path)) == (60, 10)
    _stops.tell_run_dir(str(tmp_path / "run"), {"max_steps": None, "save_every": 10})
    assert _stops.read_schedule(str(tmp_path)) is None  # no max_steps: no plan ahead
    _stops.tell_run_dir(str(tmp_path / "run"), {"max_steps": 60, "save_every": None})
    assert _stops.read_schedule(str(tmp_path)) == (60, None)


def test_the_report_says_which_launch_was_forked() -> None:
    report = VerifyReport(
        passed=True,
        command=["python", "t.py"],
        seed=0,
        reference_steps=8,
        checkpoints_compared=[4, 8],
        metrics_compared=8,
        interruptions=[
            Interruption(1, "SIGKILL", "save of step 4", 4, -9, True, "process"),
            Interruption(2, "SIGTERM", "step 6", 6, 75, False, "fork"),
        ],
        launches=3,
        resumed_from=[0, 6],
        launched=["process", "fork", "fork"],
        side_by_side=True,
    )
    text = report.summary()
    assert "SIGTERM at step 6 (a fork)" in text
    assert "launched: reference a new process; interrupted run: launch 1 new process; 2, 3 " in text
    assert "forked (pre-imported torch); beside the reference" in text
    d = report.as_dict()
    assert d["launched"] == ["process", "fork", "fork"] and d["side_by_side"] is True
    assert d["reference_launched"] == "process"
    assert [i["process"] for i in d["interruptions"]] == ["process", "fork"]


def test_a_comparison_travels_as_json_from_the_forked_child() -> None:
    """The forked comparison (unbroken.verify._compare_job) hands its findings back as JSON:
    they come back whole -- differences, a NaN's max |Δ|, the steps after a resume as ints."""
    cmp = Comparison(
        [4, 8],
        8,
        [
            Difference(8, "model", "weight", "tensor", "a", "b", float("nan")),
            Difference(6, "metrics", "loss", "metric", "1.0", "2.0"),
        ],
        {"model": "module"},
        ["sched"],
        {"optimizer": ["state.3"]},
        [{"event": "audit", "found": "x"}],
    )
    cmp.step_counts = ["optimizer.state.0.weight.step"]
    cmp.world_size = 2
    cmp.resumes = [4]
    cmp.after_resume = {5: {"loss": True}}
    cmp.not_compared = [NotCompared("counters.train_seconds", "unbroken", "wall-clock")]
    back = comparison_from_json(json.loads(json.dumps(comparison_to_json(cmp))))
    assert back.differences[1] == cmp.differences[1]
    assert back.differences[0].step == 8 and math.isnan(back.differences[0].max_abs_diff or 0)
    assert back.after_resume == {5: {"loss": True}} and back.not_compared == cmp.not_compared
    assert (back.steps, back.metrics_steps, back.kinds, back.untracked_params) == (
        cmp.steps,
        cmp.metrics_steps,
        cmp.kinds,
        cmp.untracked_params,
    )
    assert (back.world_size, back.resumes, back.step_counts, back.audit) == (
        2,
        [4],
        cmp.step_counts,
        cmp.audit,
    )
