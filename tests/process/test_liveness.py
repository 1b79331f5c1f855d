"""A rank waiting in one of unbroken's collectives learns that a peer is dead from the beats
(unbroken/_dist.py, _Liveness), not only from the backend failing the op: gloo may drop its
connection to a killed peer and never fail the op (a survivor waited the whole 600 s after a
lost node), and a survivor waiting for another survivor stuck elsewhere is never told. Three
real gloo ranks (tests/scripts/liveness.py); the same rule must not take a slow rank, or a job
stopped and continued by its scheduler, for a dead one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests import forks
from tests.golden import ROOT
from tests.ports import free_port

SCRIPT = ROOT / "tests" / "scripts" / "liveness.py"


def _start(mode: str, where: Path) -> list[forks.Launch]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "3",
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
    }
    return [
        forks.start(SCRIPT, [mode, str(where)], {**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(3)
    ]


def _finish(ranks: list[forks.Launch], waiter: int = 0) -> tuple[list[int], str]:
    results = [r.wait(timeout=120) for r in ranks]
    return [code for code, _, _ in results], results[waiter][2]


def test_a_dead_peer_ends_the_wait_of_a_rank_waiting_for_a_live_one(tmp_path: Path) -> None:
    codes, rank0 = _finish(_start("dead", tmp_path))
    assert codes == [3, 0, -signal.SIGKILL], rank0
    assert "rank(s) 2 stopped beating" in rank0, rank0
    assert "missing [2]" in rank0, rank0
    seconds = float(rank0.split("raised after ")[1].split(" s")[0])
    assert seconds < 20, rank0  # judged after ~2 s of beats; without them: the 60 s timeout


def test_when_the_rank_holding_the_store_dies_the_wait_ends(tmp_path: Path) -> None:
    """Node 0 lost: the store it held cannot be read, which ends the wait of a rank waiting
    for a live rank stuck elsewhere."""
    codes, rank1 = _finish(_start("host", tmp_path), waiter=1)
    assert codes == [-signal.SIGKILL, 3, 0], rank1
    assert "rendezvous store cannot be read" in rank1, rank1
    seconds = float(rank1.split("raised after ")[1].split(" s")[0])
    assert seconds < 20, rank1


def test_a_slow_rank_is_waited_for(tmp_path: Path) -> None:
    codes, rank0 = _finish(_start("slow", tmp_path))
    assert codes == [0, 0, 0], rank0
    assert "completed after" in rank0, rank0


@pytest.mark.parametrize("seconds", [4])
def test_a_job_stopped_and_continued_is_not_taken_for_dead(tmp_path: Path, seconds: int) -> None:
    ranks = _start("suspend", tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "waiting").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 has looked at the beats at least once
    for r in ranks:
        os.kill(r.pid, signal.SIGSTOP)  # as a scheduler suspends a job: every process
    time.sleep(seconds)  # far more than the ~2 s a dead rank is judged in
    for r in ranks:
        os.kill(r.pid, signal.SIGCONT)
    codes, rank0 = _finish(ranks)
    assert codes == [0, 0, 0], rank0
    assert "completed after" in rank0, rank0


def test_the_watchdog_ends_a_rank_stuck_in_torchs_own_collective_on_a_dead_peer(
    tmp_path: Path,
) -> None:
    """DDP's all-reduces are torch's: under a Run, a rank that has not reached run.step() for
    the watchdog's time while a peer is dead ends itself (exit 1), saying which rank; without
    the watchdog it would wait for gloo's own timeout (40 s here; 30 minutes by default)."""
    ranks = _start("watchdog", tmp_path)
    t0 = time.monotonic()
    code, _, rank0 = ranks[0].wait(timeout=120)
    took = time.monotonic() - t0
    codes = [code] + [r.wait(timeout=60)[0] for r in ranks[1:]]
    # rank 1, watching too and not stepping, ends the same way: every survivor does
    assert codes == [1, 1, -signal.SIGKILL], rank0
    assert "rank(s) 2 stopped beating" in rank0 and "ending this process" in rank0, rank0
    assert took < 30, (took, rank0)


def test_a_rank_that_ended_normally_is_not_dead(tmp_path: Path) -> None:
    codes, rank0 = _finish(_start("ended", tmp_path))
    assert codes == [0, 0, 0], rank0
    assert "survived" in rank0 and "stopped beating" not in rank0, rank0
