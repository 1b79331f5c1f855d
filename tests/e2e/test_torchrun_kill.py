"""``kill -9`` of the torchrun agent: no rank survives it, and the run resumes bit for bit.

torchrun starts each rank in a session of its own, so the ranks do not die with it; unbroken
has them notice (``PR_SET_PDEATHSIG``) and stop as on a preemption (save, exit 75), and
``unbroken run`` waits for them before relaunching (they hold the lock and the master port).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import unbroken
from tests import torchrun_helpers as tr
from tests.golden import assert_identical, trainers
from unbroken.store import CheckpointStore

STEPS, SLOW = tr.STEPS, tr.SLOW


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tr.reference_run(tmp_path_factory)


def _resume(run_dir: Path) -> None:
    tr.run_to_end(run_dir, *STEPS)


def _stops(run_dir: Path) -> list[int]:
    events = unbroken.read_metrics(str(run_dir), events=True)
    return [e["step"] for e in events if e.get("event") == "stop"]


def test_sigkill_of_the_torchrun_agent_leaves_no_rank_alive(
    tmp_path: Path, reference: Path
) -> None:
    """``kill -9`` of torchrun itself: its ranks (in sessions of their own) notice, stop, and
    exit; the relaunch takes the lock and the master port and resumes bit for bit."""
    run_dir, pids = tmp_path / "run", tmp_path / "pids"
    proc = tr.start(tr.torchrun("--run-dir", str(run_dir), "--pids", str(pids), *SLOW))
    try:
        tr.wait_for_step(run_dir, 2, proc)
        proc.kill()  # the agent only: the ranks are not in its session
        proc.communicate(timeout=tr.HANG)
        ranks = tr.rank_pids(pids)
        assert len(ranks) == 2
        assert tr.wait_gone(ranks) == [], "orphaned ranks kept running"
        # ...and they stopped rather than training on to the end: saved, and said why.
        stopped = CheckpointStore(str(run_dir)).latest()
        assert stopped is not None and stopped.step < 10, "the orphans trained to the end"
        assert _stops(run_dir) == [stopped.step]
    finally:
        for p in tr.rank_pids(pids):
            if tr.alive(p):
                os.kill(p, signal.SIGKILL)
    _resume(run_dir)
    assert_identical(reference, run_dir)


def test_unbroken_run_relaunches_after_the_agent_is_killed(tmp_path: Path, reference: Path) -> None:
    """Under ``unbroken run``, a SIGKILLed torchrun's ranks are waited for (they are the
    supervisor's to reap) before the relaunch, which then finishes the run exactly."""
    run_dir, pids, rep = tmp_path / "run", tmp_path / "pids", tmp_path / "report.json"
    cmd = tr.supervised("--json", str(rep), "--backoff", "0")
    cmd += tr.torchrun("--run-dir", str(run_dir), "--pids", str(pids), *SLOW)
    proc = tr.start(cmd)
    tr.wait_for_step(run_dir, 2, proc)
    agent = _child_of(proc.pid)
    os.kill(agent, signal.SIGKILL)
    code, out = tr.finish(proc)
    assert code == 0, out[-4000:]
    assert "LockError" not in out, out[-4000:]
    first, second = tr.report(rep)["attempts"]
    assert first["signal"] == "SIGKILL" and first["status"] == "resumable", first
    assert "2 of 2 ranks saved and stopped" in first["note"], first
    assert second["status"] == "ok"
    assert len(_stops(run_dir)) == 1  # attempt 1's ranks stopped; they did not finish the run
    assert [p for p in tr.rank_pids(pids) if tr.alive(p)] == []
    assert_identical(reference, run_dir)


def _child_of(pid: int) -> int:
    kids = trainers(pid)  # not the supervisor's persister
    assert len(kids) == 1, kids
    return kids[0]
