"""Preempted again and again under ``unbroken run -- torchrun``: stops are never crashes."""

from __future__ import annotations

from pathlib import Path

import unbroken
from tests import torchrun_helpers as tr

STEPS = ["--steps", "10", "--save-every", "3"]


def test_four_preemptions_in_a_row_still_finish(tmp_path: Path) -> None:
    """Rank 0 is SIGTERMed one step into every launch (the ranks stop after the next step):
    they save and exit 75, torchrun exits 1, and the supervisor relaunches each time without
    counting a crash (--max-retries 0 would give up at the first); the fifth launch finishes.
    (That a stop under torchrun resumes bit for bit is test_torchrun.py's.)"""
    run_dir, rep = tmp_path / "run", tmp_path / "report.json"
    cmd = tr.supervised("--max-retries", "0", "--json", str(rep))
    cmd += tr.torchrun("--run-dir", str(run_dir), *STEPS, "--preempt-after", "1")
    code, out = tr.finish(tr.start(cmd))
    assert code == 0, out[-4000:]
    attempts = tr.report(rep)["attempts"]
    assert [a["status"] for a in attempts] == ["resumable"] * 4 + ["ok"], attempts
    assert all(a["crash"] == 0 and a["returncode"] == 1 for a in attempts[:4])  # torchrun's 1
    records = unbroken.read_metrics(str(run_dir), events=True)
    assert [r["step"] for r in records if r.get("event") == "stop"] == [2, 4, 6, 8]
    assert [r["step"] for r in records if "event" not in r] == list(range(1, 11))
