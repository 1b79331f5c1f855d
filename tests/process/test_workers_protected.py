"""DataLoader workers leave stop signals to the main process (``unbroken.protect_workers``).

Real worker processes, real signals: the stop signals sent to the workers of a protected torch
DataLoader -- while they start and while they serve batches -- change nothing; the same signals
kill an unprotected loader's workers (the failure a scheduler's tree-wide stop caused; torch then
raises in the main process, or waits forever: tests/scripts/worker_signals.py). Each case runs in
a process of its own, so a regression fails the test instead of hanging the suite. A script that
ends with protected persistent workers alive (which ignore the SIGTERM multiprocessing sends at
exit) still exits at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.golden import ROOT

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SCRIPT = ROOT / "tests" / "scripts" / "worker_signals.py"


def _python(*argv: str) -> subprocess.CompletedProcess[str]:
    # 120 s: a hang (multiprocessing waiting for workers forever) fails the test, not the suite.
    return subprocess.run(
        [sys.executable, *argv],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _signalled(*args: str) -> dict:
    proc = _python(str(SCRIPT), *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_protected_workers_ignore_stop_signals() -> None:
    out = _signalled("--protect")
    assert out["workers"] == 2
    assert out["exit_codes"] == [None, None]
    assert out["raised"] == []
    assert out["got"] == list(range(32))


def test_unprotected_workers_die_of_them() -> None:
    # The failure protect_workers prevents (so the test above can fail): every worker dies of
    # one of the signals while it starts (which one: the kernel delivers pending signals lowest
    # number first). Whether torch's SIGCHLD handler raises in the main process meanwhile is a
    # race (it does in most runs, not all): the deaths are the failure.
    out = _signalled()
    assert out["workers"] == 2
    assert all(c is not None and -c in STOPS for c in out["exit_codes"]), out
    assert out["got"] == []


_EXIT = r"""
import time, torch, unbroken
data = torch.utils.data.TensorDataset(torch.arange(8))
loader = unbroken.protect_workers(
    torch.utils.data.DataLoader(data, num_workers=2, persistent_workers=True))
assert len(list(loader)) == 8
keep = loader  # persistent workers alive at exit
print("end", flush=True)
"""


def test_a_script_ending_with_protected_persistent_workers_exits_at_once() -> None:
    t0 = time.monotonic()
    proc = _python("-c", _EXIT)
    assert proc.returncode == 0 and proc.stdout.strip() == "end", proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 100
