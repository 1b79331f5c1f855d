"""The metrics log is fsynced with each checkpoint; one shorter than its checkpoint records
(what a power loss leaves when the log's tail never reached the disk) is repaired to whole lines
and reported, never appended to so that two records merge into one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.golden import ROOT, launch
from unbroken import read_metrics
from unbroken.store import CheckpointStore

TOY = ROOT / "tests" / "scripts" / "toy_train.py"
ARGS = ["--steps", "12", "--save-every", "4"]


def test_a_log_cut_short_mid_line_is_repaired_reported_and_stays_whole(tmp_path, monkeypatch):
    """A power loss cuts the log in the middle of step 7's line, behind checkpoint 8. The
    relaunch repairs it to whole lines and says so; killed again before the next checkpoint and
    resumed from checkpoint 8 once more (whose recorded length no longer falls on its line),
    the log neither gets a line cut in half nor keeps the steps that are redone. Every save
    fsyncs the log before it commits."""
    run = tmp_path / "run"
    assert launch(TOY, [*ARGS, "--run-dir", str(run), "--signal-at", "10"]) == -9
    reader = CheckpointStore(str(run)).latest()
    assert reader is not None and reader.step == 8
    recorded = reader.global_trees()["counters"]["metrics_offset"]
    log = run / "metrics.jsonl"
    raw = log.read_bytes()
    cut = raw.index(b'{"step": 7') + 10
    assert cut < recorded
    log.write_bytes(raw[:cut])

    proc = subprocess.run(
        [sys.executable, str(TOY), *ARGS, "--run-dir", str(run), "--signal-at", "11"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    assert "metrics log" in proc.stderr and "were lost" in proc.stderr, proc.stderr
    for line in log.read_bytes().splitlines():
        json.loads(line)  # every line is one whole record: nothing merged
    # Steps 9-11 (no checkpoint since 8) may have been held in memory and lost to the kill,
    # all or the last of them (a process's first seconds flush often); the relaunch redoes them.
    steps = [m["step"] for m in read_metrics(run)]
    assert steps == [1, 2, 3, 4, 5, 6, *range(9, 9 + len(steps) - 6)] and len(steps) <= 9, steps
    gap = [m for m in read_metrics(run, events=True) if m.get("event") == "log_gap"]
    assert len(gap) == 1 and gap[0]["missing_bytes"] == recorded - cut, gap

    events = tmp_path / "events.log"
    monkeypatch.setenv("UNBROKEN_FAULT_LOG", str(events))
    assert launch(TOY, [*ARGS, "--run-dir", str(run)]) == 0
    for line in log.read_bytes().splitlines():
        json.loads(line)
    steps = [m["step"] for m in read_metrics(run)]
    assert steps == [1, 2, 3, 4, 5, 6, 9, 10, 11, 12], steps  # 7 and 8 lost, not redone

    # The relaunch saved step 12: the log was fsynced before that checkpoint was renamed in.
    lines = [ln.split("\t") for ln in events.read_text().splitlines()]
    rename = next(i for i, (_, ev, name) in enumerate(lines) if ev == "rename" and "step-" in name)
    assert ["fsync_log", "metrics.jsonl"] in [ln[1:] for ln in lines[:rename]], lines


def test_read_metrics_leaves_out_a_line_being_written(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2}\n{"ste')
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2}]
