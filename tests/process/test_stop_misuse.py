"""A loop driven wrongly is named loudly: no ``run.step()``, or two per batch.

Without ``run.step()`` nothing is counted or saved and a stop signal has no safe point to be
honoured at, so a run would train to the end deaf to SIGTERM; the end of an epoch (of
``run.epochs()`` or ``run.loop()``) raises a ConfigError naming ``run.step()``, and a
process stopped that way exits 1 (an error the user can read), not 0 after ignoring the stop.
The in-process cases drive a real Run; the signal case is a real process and a real SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import unbroken
from tests.golden import ROOT
from unbroken import ConfigError


def _loader(n: int = 12, batch: int = 4) -> unbroken.MapLoader:
    data = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32)[:, None])
    return unbroken.MapLoader(data, batch_size=batch, shuffle=True, seed=0)


def test_an_epoch_without_run_step_is_an_error_naming_it(tmp_path: Path) -> None:
    loader = _loader()
    run = unbroken.Run(tmp_path / "run", loader=loader, progress=False)
    try:
        with pytest.raises(ConfigError, match=r"epoch 0: the loader yielded 3 batches"):
            for _epoch in run.epochs(3):
                for _batch in loader:
                    pass  # forward, backward, optimizer.step() -- and no run.step()
    finally:
        run.close()


def test_run_loop_without_run_step_is_an_error_at_the_epoch_end(tmp_path: Path) -> None:
    loader = _loader()
    run = unbroken.Run(tmp_path / "run", loader=loader, progress=False, max_steps=100)
    seen = 0
    try:
        with pytest.raises(ConfigError, match=r"epoch 0: the loader yielded 3 batches"):
            for _batch in run.loop(loader):
                seen += 1
    finally:
        run.close()
    assert seen == 3, "the second epoch must not start"


def test_run_step_twice_for_one_batch_is_a_warning_naming_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loader = _loader()
    run = unbroken.Run(tmp_path / "run", loader=loader, progress=False)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        for _batch in run.loop(loader, epochs=1):
            run.step()
            run.step()  # e.g. once in the loop body and once in a helper it calls
    warned = [r.getMessage() for r in caplog.records if "without a new batch" in r.getMessage()]
    assert len(warned) == 1, warned  # once, not per step
    assert "once per optimizer step" in warned[0], warned[0]
    assert run.counters.step == 6


def test_a_run_stepping_once_per_batch_is_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loader = _loader()
    run = unbroken.Run(tmp_path / "run", loader=loader, progress=False)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        for _epoch in run.epochs(2):
            for _batch in loader:
                run.step()
    assert not [r for r in caplog.records if "run.step()" in r.getMessage()]


_NO_STEP = r"""
import os, sys, time
import torch, unbroken
data = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32)[:, None])
loader = unbroken.MapLoader(data, batch_size=4, shuffle=True, seed=0, num_workers=1)
run = unbroken.Run(sys.argv[1], loader=loader, progress=False)
print("start", flush=True)
for epoch in run.epochs(50):
    for i, batch in enumerate(loader):
        if epoch == 0 and i == 0:
            # Inside the first batch (a fetch now is not a step boundary): the test sends
            # SIGTERM now; wait until it is recorded (at most 5 s after the test's "sent"
            # file, 60 s in all) so that it lands here however loaded the machine.
            print("batch 0", flush=True)
            deadline = time.monotonic() + 60
            while not run._stop.requested and time.monotonic() < deadline:
                if os.path.exists(sys.argv[1] + ".sent"):
                    deadline = min(deadline, time.monotonic() + 5)
                time.sleep(0.01)
        time.sleep(0.05)  # a training step, without run.step()
    print("epoch", epoch, flush=True)
print("done", flush=True)
"""


def test_a_stop_without_run_step_ends_at_the_epoch_end_with_that_error(tmp_path: Path) -> None:
    script = tmp_path / "no_step.py"
    script.write_text(_NO_STEP)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run")],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "start"
    assert proc.stdout.readline().strip() == "batch 0"  # the child waits for the SIGTERM
    proc.send_signal(signal.SIGTERM)
    Path(f"{tmp_path / 'run'}.sent").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (proc.returncode, out, err)  # documented: an error, exit 1
    assert "ConfigError" in err and "run.step() was never called" in err, err
    assert "epoch 1" not in out and "done" not in out, out  # ended in its first epoch


# ---- after a Run closed (real signals to this process) -----------------------------------------


def test_a_stop_after_a_closed_run_is_kept_for_the_next_run(tmp_path: Path) -> None:
    from unbroken.process import _signals

    run = unbroken.Run(tmp_path / "a", max_steps=1, progress=False)
    for _ in run.loop(range(3)):
        run.step()
    assert run.closed
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, never raised into this test
        time.sleep(0.05)
        assert _signals.pending() == "SIGTERM"
        with pytest.raises(SystemExit) as stopped:
            unbroken.Run(tmp_path / "b", max_steps=1, progress=False)
        assert stopped.value.code == 75
        assert not (tmp_path / "b").exists()  # before anything was opened
    finally:
        _signals._pending = None


def test_ctrl_c_in_an_interactive_session_is_a_keyboard_interrupt_outside_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = unbroken.Run(tmp_path / "a", max_steps=1, progress=False)
    for _ in run.loop(range(3)):
        run.step()
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # a REPL
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
