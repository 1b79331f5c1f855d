"""DataLoader workers die with their trainer and never hold its lock (issue 15, item 4).

A trainer with 2 workers is SIGKILLed from outside (a real second process); its workers must
be gone at once (``PR_SET_PDEATHSIG``) rather than when torch's watchdog notices, and an
immediate relaunch must take the writer lock (the workers closed their inherited copies of it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.golden import ROOT
from unbroken import read_metrics
from unbroken.process._tree import children
from unbroken.store import WriterLock

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may be slow to reap the orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_sigkill_of_the_trainer_frees_its_lock_and_its_workers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["--steps", "400", "--save-every", "1000", "--workers", "2", "--persistent"]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args, "--run-dir", str(run), "--step-sleep", "0.05"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if len(read_metrics(str(run))) >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        else:
            raise AssertionError("the trainer never logged 3 steps")
        workers = children(proc.pid)
        assert len(workers) >= 2, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        WriterLock(str(run)).acquire()  # at once: no worker holds a copy of the trainer's lock
        # They notice within ~0.1 s; 30 s is what a loaded machine may take to schedule them
        # (the loop ends as soon as they are gone). A worker that never exits still fails.
        end = time.monotonic() + 30.0
        while time.monotonic() < end and any(_running(w) for w in workers):
            time.sleep(0.01)
        alive = [w for w in workers if _running(w)]
        assert not alive, f"workers {alive} outlived the trainer by more than 30 s"
    finally:
        if proc.poll() is None:
            proc.kill()
