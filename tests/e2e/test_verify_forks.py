"""`unbroken verify` at its cost: the interrupted run beside the reference (a new process), its
launches forked from a pre-imported interpreter, which also runs the comparison -- and the
verdict as honest as with new processes (tests/e2e/test_seeded_bugs.py runs every seeded bug
through the forks too)."""

from __future__ import annotations

import json
import os
import subprocess
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
def test_the_interrupted_launches_are_forked_and_the_reference_is_a_new_process(
    tmp_path: Path,
) -> None:
    report = verify_resume([PY, str(TOY), *TOY_ARGS], interrupts=3, work_dir=tmp_path)
    assert report.passed, report.summary()
    assert report.checkpoints_compared == [4, 8, 12, 16]
    assert report.side_by_side == (_cores() >= 2)
    assert report.reference_launched == "process"
    assert report.launched == ["fork"] * report.launches, report.launched
    (save,) = [i for i in report.interruptions if i.moment.startswith("save of step")]
    assert save.process == "fork" and save.during_save  # a real SIGKILL to a forked child
    for i in report.interruptions:
        assert i.process == report.launched[i.launch - 1]
    assert "forked (pre-imported torch)" in report.summary()
    # The comparison ran in a child of the fork server.
    assert (tmp_path / "compare.json").is_file()


NO_TORCH = """
import json, sys
from unbroken.verify import verify_resume
report = verify_resume(json.loads(sys.argv[1]), interrupts=1, work_dir=sys.argv[2])
print(json.dumps([report.passed, report.launched, "torch" in sys.modules]))
"""


@pytest.mark.usefixtures("slow_saves")
def test_verify_itself_never_imports_torch_when_it_forks(tmp_path: Path) -> None:
    """torch is imported by the fork server (which also runs the comparison), not by verify:
    an import of torch there is seconds of start-up on verify's critical path."""
    cmd = json.dumps([PY, str(TOY), *TOY_ARGS])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [PY, "-c", NO_TORCH, cmd, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    passed, launched, torch_imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert passed and launched == ["fork", "fork"], out.stdout
    assert not torch_imported
    assert (tmp_path / "compare.json").is_file()


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
    loader = unbroken.MapLoader(data, batch_size=4, shuffle=True, seed=0)
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
