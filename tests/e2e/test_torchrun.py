"""``unbroken run -- torchrun ...`` keeps the stop contract end to end (2 gloo ranks on CPU).

Real torchrun from the venv starts the ranks in sessions of their own, exits 1 when they exit
75 and does not handle SIGUSR1. Checked here: a stop signal to the supervisor reaches every
rank, the ranks save and stop, and the supervisor reports 75 (under SLURM: requeues); a
SIGKILL of the torchrun agent leaves no rank alive. Every resumed run ends bitwise equal to an
uninterrupted one (every tensor, all state, the per-step log). The launcher's death:
test_torchrun_kill.py; preemption after preemption: test_torchrun_preempt.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests import torchrun_helpers as tr
from tests.golden import assert_identical
from unbroken.store import CheckpointStore

STEPS, SLOW = tr.STEPS, tr.SLOW

FAKE_SCONTROL = """#!/bin/sh
echo "$@" >> "$SCONTROL_LOG"
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tr.reference_run(tmp_path_factory)


def _resume(run_dir: Path) -> None:
    tr.run_to_end(run_dir, *STEPS)


def _fake_scontrol(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(FAKE_SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    return tr.env(
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        SLURM_JOB_ID="4321",
    )


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_stop_signal_to_unbroken_run_stops_every_rank_with_75(
    tmp_path: Path, reference: Path, sig: str
) -> None:
    """SIGTERM (scancel) or SIGUSR1 (``--signal=B:USR1@120``) to ``unbroken run -- torchrun``:
    every rank saves the same step and stops, no rank outlives the supervisor, the exit is 75
    -- with SIGUSR1 under SLURM (a fake scontrol on PATH) after requeueing the job."""
    run_dir, pids, rep = tmp_path / "run", tmp_path / "pids", tmp_path / "report.json"
    slurm = sig == "SIGUSR1"
    cmd = tr.supervised("--json", str(rep))
    # With SIGTERM the ranks have DataLoader workers too (they ignore stop signals; the data
    # stream is the same for any number of workers, so the reference needs none).
    workers = [] if slurm else ["--workers", "2"]
    cmd += tr.torchrun("--run-dir", str(run_dir), "--pids", str(pids), *SLOW, *workers)
    proc = tr.start(cmd, _fake_scontrol(tmp_path) if slurm else None)
    tr.wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.Signals[sig])
    code, out = tr.finish(proc)
    assert code == 75, out[-4000:]
    ranks = tr.rank_pids(pids)
    assert len(ranks) == 2
    assert [p for p in ranks if tr.alive(p)] == [], "a rank outlived the supervisor"
    r = tr.report(rep)
    assert len(r["attempts"]) == 1 and r["attempts"][0]["status"] == "resumable", r
    if slurm:
        assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4321"]
        assert r["requeued"] is True
    else:
        assert r["attempts"][0]["action"] == "stop"
    stopped = CheckpointStore(str(run_dir)).latest()
    assert stopped is not None and 2 <= stopped.step < 10 and stopped.world_size == 2
    if sig == "SIGTERM":  # one resume is enough to show the stop's checkpoint is exact
        _resume(run_dir)
        assert_identical(reference, run_dir)


def test_torchrun_takes_abbreviations_of_its_options_after_the_script(tmp_path: Path) -> None:
    """torchrun does not stop parsing at the script path: a script option that abbreviates
    one of torchrun's (``--signal`` for ``--signals-to-handle``) is refused as ambiguous. A
    ``--`` after the script path passes everything behind it to the script (docs/distributed.md)."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys; print('ARGS', sys.argv[1:])\n")
    one = ["--nproc_per_node", "1"]
    bad = tr.torchrun("--signal", "TERM", script=probe)
    bad[1:3] = one  # one process is enough here
    r = subprocess.run(bad, env=tr.env(), capture_output=True, text=True, timeout=tr.HANG)
    assert r.returncode == 2 and "ambiguous option: --signal" in r.stderr, r.stderr[-3000:]
    good = tr.torchrun("--", "--signal", "TERM", "--max-restarts", "3", script=probe)
    good[1:3] = one
    r = subprocess.run(good, env=tr.env(), capture_output=True, text=True, timeout=tr.HANG)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ARGS ['--signal', 'TERM', '--max-restarts', '3']" in r.stdout
