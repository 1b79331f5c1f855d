"""`unbroken verify` at its cost: the interrupted run beside the reference, its first launch
(killed during a save) a new process, its relaunches forked from a pre-imported interpreter --
and the verdict as honest as with new processes (tests/e2e/test_seeded_bugs.py runs every seeded
bug through the forks too)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tests import faults
from tests.golden import ROOT
from unbroken.verify import ScriptFailedError, verify_resume
from unbroken.verify._runner import _cores

PY = sys.executable
TOY = ROOT / "tests" / "scripts" / "toy_train.py"
TOY_ARGS = ["--run-dir", "{run_dir}", "--steps", "16", "--save-every", "4"]


@pytest.fixture
def slow_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A toy save takes a millisecond: slowed, the kill aimed inside one lands there."""
    monkeypatch.setenv(faults.PLAN_ENV, "slow:0.06")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.usefixtures("slow_saves")
def test_relaunches_are_forked_and_the_save_kill_is_a_new_process(tmp_path: Path) -> None:
    report = verify_resume([PY, str(TOY), *TOY_ARGS], interrupts=3, work_dir=tmp_path)
    assert report.passed, report.summary()
    assert report.checkpoints_compared == [4, 8, 12, 16]
    assert report.side_by_side == (_cores() >= 2)
    assert report.launched[0] == "process" and "fork" in report.launched, report.launched
    assert report.reference_launched == "fork"
    assert len(report.launched) == report.launches
    (save,) = [i for i in report.interruptions if i.moment.startswith("save of step")]
    assert save.launch == 1 and save.process == "process" and save.during_save
    for i in report.interruptions:
        assert i.process == report.launched[i.launch - 1]
    assert "forked (pre-imported torch)" in report.summary()


@pytest.mark.usefixtures("slow_saves")
def test_no_fork_and_one_at_a_time(tmp_path: Path) -> None:
    report = verify_resume(
        [PY, str(TOY), *TOY_ARGS], interrupts=1, work_dir=tmp_path, fork=False, side_by_side=False
    )
    assert report.passed, report.summary()
    assert report.launched == ["process", "process"] and not report.side_by_side
    assert report.reference_launched == "process"


RESUME_FAILS = """
    import os, sys, time, torch, unbroken

    unbroken.seed_everything(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 2), torch.randn(32, 1))
    loader = unbroken.DataLoader(data, batch_size=4, shuffle=True, seed=0)
    run = unbroken.Run(os.environ["UNBROKEN_RUN_DIR"], model=model, optimizer=opt,
                       loader=loader, save_every=2, max_steps=16)
    if run.counters.step > 0:
        print("refusing to resume", flush=True)
        sys.exit(3)
    for x, y in run.loop(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
        run.step(loss=loss)
"""


def test_a_forked_relaunch_fails_with_the_scripts_own_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(RESUME_FAILS))
    with pytest.raises(ScriptFailedError, match="launch 2 of the interrupted run exited 3") as e:
        verify_resume([PY, str(script)], interrupts=1, work_dir=tmp_path / "work")
    assert e.value.returncode == 3 and "refusing to resume" in e.value.log
