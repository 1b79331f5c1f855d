"""on_epoch_start runs exactly once per epoch, at the first step that consumes a sample of it,
whatever the gradient accumulation, and a resume changes nothing (issue 17, finding 6).

Found from outside: with grad_accum 2-3 every epoch whose first micro-batch fell inside a step
begun in the previous epoch never got on_epoch_start. Real processes: tests/scripts/
epoch_hooks.py runs straight, then signals itself (SIGTERM, or SIGKILL, which loses the steps
since the last save) and is relaunched; the logged hook calls and losses must be identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.golden import ROOT
from unbroken import read_metrics

SCRIPT = ROOT / "tests" / "scripts" / "epoch_hooks.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _launch(run: Path, *args: str) -> int:
    cmd = [sys.executable, str(SCRIPT), "--run-dir", str(run), *args]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 75, -9), proc.stderr[-3000:]
    return proc.returncode


def _records(run: Path) -> list[dict]:
    return [
        {k: r[k] for k in ("step", "loss", "epoch_starts", "batch_epochs")}
        for r in read_metrics(str(run))
    ]


def _check_once_per_epoch(records: list[dict]) -> None:
    seen: set[int] = set()
    for r in records:
        fresh = [e for e in dict.fromkeys(r["batch_epochs"]) if e not in seen]
        assert r["epoch_starts"] == fresh, (r["step"], r)
        seen.update(fresh)


@pytest.mark.slow
@pytest.mark.parametrize(("accum", "sig"), [(2, "KILL"), (3, "TERM"), (3, "KILL")])
def test_on_epoch_start_once_per_epoch_across_resume(tmp_path: Path, accum: int, sig: str) -> None:
    straight = tmp_path / "straight"
    assert _launch(straight, "--accum", str(accum)) == 0
    reference = _records(straight)
    assert len(reference) == 12
    _check_once_per_epoch(reference)
    assert [e for r in reference for e in r["epoch_starts"]] == list(
        range(reference[-1]["batch_epochs"][-1] + 1)
    )

    interrupted = tmp_path / "interrupted"
    codes = [_launch(interrupted, "--accum", str(accum), "--signal-at", "5", "--signal", sig)]
    while codes[-1] != 0 and len(codes) < 4:
        codes.append(_launch(interrupted, "--accum", str(accum)))
    assert codes[0] == (75 if sig == "TERM" else -9) and codes[-1] == 0, codes
    assert _records(interrupted) == reference
