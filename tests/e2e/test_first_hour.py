"""What a new user meets in the first hour, and the traps nothing warned about: a resume is
announced on stderr, an untracked optimizer is named (at its first step, and first among
verify's hints), an unwritable run directory is a CheckpointWriteError at ``Run()``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import unbroken
from tests.golden import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# A tiny loop; argv: RUN_DIR STEPS [quiet] [late-optimizer]
SCRIPT = """
import logging, sys, torch, unbroken
run_dir, steps, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
if "quiet" in flags:
    logging.getLogger("unbroken").setLevel(logging.WARNING)
unbroken.seed_everything(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = unbroken.MapLoader(data, batch_size=8, shuffle=True, seed=0)
late = "late-optimizer" in flags
opt = None if late else torch.optim.AdamW(model.parameters(), lr=1e-2)
tracked = {} if late else {"optimizer": opt}
run = unbroken.Run(run_dir, model=model, loader=loader, **tracked, save_every=3, max_steps=steps)
if late:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # created after Run(), not passed
for x, y in run.loop(loader):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    run.step(loss=loss)
"""


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---- the resume is announced -----------------------------------------------------------------


def test_a_resume_is_one_line_on_stderr_by_default(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = _launch(tmp_path, str(run_dir), "4")
    assert first.returncode == 0, first.stderr
    assert "resumed" not in first.stderr  # a fresh start says nothing
    second = _launch(tmp_path, str(run_dir), "7")
    assert second.returncode == 0, second.stderr
    lines = [line for line in second.stderr.splitlines() if "resumed" in line]
    assert lines == [f"unbroken: resumed {run_dir} from step 4 (checkpoints/step-000000004)"]


def test_the_resume_line_is_quiet_when_asked(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _launch(tmp_path, str(run_dir), "3", "quiet").returncode == 0
    second = _launch(tmp_path, str(run_dir), "6", "quiet")
    assert second.returncode == 0, second.stderr
    assert "resumed" not in second.stderr


def test_with_logging_configured_the_resume_is_an_info_record(tmp_path: Path, caplog) -> None:
    model = torch.nn.Linear(2, 2)
    with unbroken.Run(tmp_path / "run", model=model, progress=False) as run:
        run.step()
    with caplog.at_level("INFO", logger="unbroken"):
        unbroken.Run(tmp_path / "run", model=model, progress=False).close()
    resumed = [r for r in caplog.records if "resumed" in r.getMessage()]
    assert len(resumed) == 1 and resumed[0].levelname == "INFO"
    assert resumed[0].step == 1 and resumed[0].path.endswith("step-000000001")


# ---- an optimizer not passed to Run ----------------------------------------------------------


def test_an_untracked_optimizer_is_named_at_its_first_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    run = unbroken.Run(tmp_path / "run", model=model, progress=False, max_steps=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            run.step()
    run.finish()
    found = [x for x in w if issubclass(x.category, unbroken.ResumeWarning)]
    assert len(found) == 1, [str(x.message) for x in w]  # once, not at every step
    assert "SGD" in str(found[0].message) and "'model'" in str(found[0].message)
    assert "Run(..., optimizer=opt)" in str(found[0].message)
    audits = [e for e in unbroken.read_metrics(tmp_path / "run", events=True) if "event" in e]
    assert any(e.get("check") == "untracked_optimizer" for e in audits), audits


def test_a_tracked_or_unrelated_optimizer_is_not_named(tmp_path: Path) -> None:
    model, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = unbroken.Run(tmp_path / "run", model=model, optimizer=opt, progress=False)
    side = torch.optim.SGD(other.parameters(), lr=0.1)  # trains nothing tracked
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for o, m in ((opt, model), (side, other)):
            m(torch.ones(1, 4)).sum().backward()
            o.step()
        run.step()
    run.close()
    assert not [x for x in w if issubclass(x.category, unbroken.ResumeWarning)]


def test_verify_names_the_untracked_optimizer_first(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, str(script), "{run_dir}", "12", "late-optimizer"]
    report = unbroken.verify_resume(cmd, interrupts=1, seed=0, work_dir=tmp_path / "v")
    assert not report.passed
    assert report.hints[0].startswith("An untracked optimizer: AdamW updates 'model'"), report.hints


# ---- a run directory that cannot be written ---------------------------------------------------


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs holding a directory, remounted read-only for the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)])
    if proc.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (mnt / "existing").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("name", ["new/run", "existing", "."])
def test_a_read_only_run_directory_is_a_checkpoint_write_error(
    read_only_disk: Path, name: str
) -> None:
    run_dir = read_only_disk / name
    with pytest.raises(unbroken.errors.CheckpointWriteError) as e:
        unbroken.Run(run_dir, model=torch.nn.Linear(2, 2), progress=False)
    text = str(e.value)
    assert f"the run directory {os.path.abspath(run_dir)}" in text
    assert "read-only file system" in text and "give Run a directory" in text
