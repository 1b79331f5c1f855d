"""DataLoader workers leave stop signals to the main process (``unbroken.protect_workers``).

Real worker processes, real signals: the stop signals sent to the workers of a protected torch
DataLoader -- while they start and while they serve batches -- change nothing; the same signals
kill an unprotected loader's workers, and torch then raises in the main process (the failure a
scheduler's tree-wide stop caused). A script that ends with protected persistent workers alive
(which ignore the SIGTERM multiprocessing sends at exit) still exits at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import unbroken
from tests.golden import ROOT

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.02)
        return torch.tensor([i])


def _signal_workers() -> int:
    kids = [p.pid for p in multiprocessing.active_children()]
    for pid in kids:
        for sig in STOPS:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return len(kids)


def _drain(loader: torch.utils.data.DataLoader) -> list[int]:
    it = iter(loader)
    assert _signal_workers() == 2  # while they start
    got = [int(next(it)[0])]
    time.sleep(0.2)
    assert _signal_workers() == 2  # while they serve
    got += [int(b[0]) for b in it]
    return got


def test_protected_workers_ignore_stop_signals() -> None:
    loader = unbroken.protect_workers(torch.utils.data.DataLoader(Slow(), num_workers=2))
    assert _drain(loader) == list(range(32))


def test_unprotected_workers_die_of_them_and_torch_raises() -> None:
    # The failure protect_workers prevents (so the test above can fail).
    loader = torch.utils.data.DataLoader(Slow(), num_workers=2)
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        _drain(loader)


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
    proc = subprocess.run(
        [sys.executable, "-c", _EXIT],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,  # a hang: multiprocessing would wait for the workers forever
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "end", proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 100
