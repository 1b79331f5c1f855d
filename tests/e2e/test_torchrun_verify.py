"""``unbroken verify -- torchrun --nproc_per_node 2 ...``: the job is interrupted for real.

torchrun starts its ranks in sessions of their own, so verify signals every process of the
job (as a scheduler does), takes a launch whose ranks all saved and stopped for a stop though
torchrun exits 1, and would refuse a kill after which a step was still logged. A correct
2-rank DDP script passes; the same script with an untracked generator fails, naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests import torchrun_helpers as tr

STEPS = ["--steps", "12", "--save-every", "3", "--step-sleep", "0.05"]


def _verify(work: Path, interrupts: int, *script_args: str) -> tuple[int, dict[str, Any], str]:
    argv = [sys.executable, "-m", "unbroken", "verify", "--json", "--quiet"]
    argv += ["--interrupts", str(interrupts), "--work", str(work), "--"]
    argv += tr.torchrun("--", "--run-dir", "{run_dir}", *STEPS, *script_args)
    proc = subprocess.run(argv, env=tr.env(), capture_output=True, text=True, timeout=400)
    assert proc.stdout, proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def test_a_correct_script_passes_under_torchrun(tmp_path: Path) -> None:
    code, report, err = _verify(tmp_path / "work", 2)
    assert code == 0, (report, err[-3000:])
    assert report["passed"] is True
    # Both interruptions happened (a SIGKILL of the whole job, then a SIGTERM or a kill in a
    # save), each launch after them resumed from a checkpoint.
    assert len(report["interruptions"]) == 2, report
    assert report["launches"] == 3 and all(s > 0 for s in report["resumed_from"]), report


def test_an_untracked_generator_is_caught_under_torchrun(tmp_path: Path) -> None:
    code, report, err = _verify(tmp_path / "work", 1, "--bug", "generator")
    assert code == 1, (report, err[-3000:])
    assert report["passed"] is False
    assert "generator" in report["hints"][0], report["hints"]
