"""The pieces under the torchrun tests, on their own: stop markers and the job's process tree.

Real processes (plain Python, no torch): a stand-in "agent" starts two "ranks" with torchrun's
``TORCHELASTIC_RUN_ID`` in their environment, as torchrun does, each in a session of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from unbroken.process import _stops, _tree

# Starts two ranks in sessions of their own that handle SIGUSR1 (they write a file and exit),
# prints their pids, then waits for them; it has no handler for SIGUSR1 itself (like torchrun).
AGENT = """\
import os, subprocess, sys
rank = '''
import os, signal, sys, time
def stop(s, f):
    open(sys.argv[1] + "." + os.environ["RANK"], "w").write("stopped")
    sys.exit(75)
if sys.argv[2] == "handle":
    signal.signal(signal.SIGUSR1, stop)
open(sys.argv[1] + ".ready." + os.environ["RANK"], "w").close()
time.sleep(60)
'''
kids = [subprocess.Popen([sys.executable, "-c", rank, *sys.argv[1:]], start_new_session=True,
                         env={**os.environ, "TORCHELASTIC_RUN_ID": "x", "RANK": str(r)})
        for r in range(2)]
print(" ".join(str(k.pid) for k in kids), flush=True)
sys.exit(max(k.wait() for k in kids) and 1)
"""


def _wait(paths: list[Path]) -> None:
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.01)


def test_stop_signal_goes_to_the_ranks_not_to_the_agent(tmp_path: Path) -> None:
    tag = _tree.new_tag()
    out = tmp_path / "rank"
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(out), "handle"],
        env={**os.environ, _tree.TAG_ENV: tag},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        ranks = [int(p) for p in agent.stdout.readline().split()]  # type: ignore[union-attr]
        _wait([tmp_path / f"rank.ready.{r}" for r in range(2)])
        tree = _tree.Tree(agent.pid, tag)
        assert set(tree.members()) == {agent.pid, *ranks}
        assert _tree.agents(tree.members()) == {agent.pid}
        targets = tree.stop_targets(signal.SIGUSR1)
        assert sorted(targets) == sorted(ranks)  # not the agent: SIGUSR1 would kill it
        tree.send(signal.SIGUSR1, targets)
        assert agent.wait(timeout=60) == 1  # its ranks exited 75; it reports a failure
        assert [(tmp_path / f"rank.{r}").read_text() for r in range(2)] == ["stopped"] * 2
        assert tree.wait_gone(60) == []
    finally:
        _tree.Tree(agent.pid, tag).kill()


def test_kill_reaches_ranks_in_their_own_sessions_after_the_agent_is_gone(tmp_path: Path) -> None:
    tag = _tree.new_tag()
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path / "rank"), "handle"],
        env={**os.environ, _tree.TAG_ENV: tag},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ranks = [int(p) for p in agent.stdout.readline().split()]  # type: ignore[union-attr]
    # Running Python, not still inside exec: Popen returns before the kernel has set up the new
    # program's environment, and for that moment /proc/PID/environ reads empty (a CI run on a
    # loaded machine caught rank 1 there, untagged). The supervisor's scans repeat; this one not.
    _wait([tmp_path / f"rank.ready.{r}" for r in range(2)])
    os.killpg(agent.pid, signal.SIGKILL)  # the agent's group: the ranks are not in it
    agent.wait()
    assert all(_tree.alive(p) for p in ranks)  # orphans, found by their tag
    tree = _tree.Tree(agent.pid, tag)
    assert sorted(tree.members()) == sorted(ranks)
    tree.kill()
    assert not any(_tree.alive(p) for p in ranks)


def _marker(where: Path, **fields: object) -> None:
    where.mkdir(exist_ok=True)
    base = {"world_size": 2, "local_world_size": 2, "node": 0, "restart": 0, "step": 6}
    m = {**base, **fields}
    m.setdefault("local_rank", m["rank"])
    (where / f"rank-{m['rank']:05d}.json").write_text(json.dumps(m))


def test_all_stopped_needs_every_rank(tmp_path: Path) -> None:
    d = tmp_path / "stops"
    assert _stops.all_stopped(str(d)) is None  # no directory: nobody stopped
    _marker(d, rank=0)
    assert _stops.all_stopped(str(d)) is None  # rank 1 crashed, or is still running
    _marker(d, rank=1)
    assert _stops.all_stopped(str(d)) == "2 of 2 ranks saved and stopped at step 6"


def test_all_stopped_on_one_node_of_several(tmp_path: Path) -> None:
    d = tmp_path / "stops"
    for r in (4, 5):  # node 2 of a 6-rank job, 2 ranks per node
        _marker(d, rank=r, local_rank=r - 4, world_size=6, node=2)
    assert (
        _stops.all_stopped(str(d)) == "the 2 ranks of this node (of 6) saved and stopped at step 6"
    )
    _marker(d, rank=0, local_rank=0, world_size=6, node=0)  # another node's: not a node's set
    assert _stops.all_stopped(str(d)) is None


def test_record_writes_where_the_launcher_asked(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(_stops.ENV, str(tmp_path / "stops"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _stops.record(3, "signal SIGTERM")
    (m,) = _stops.read(str(tmp_path / "stops"))
    assert (m["rank"], m["world_size"], m["step"], m["pid"]) == (0, 1, 3, os.getpid())
    assert _stops.all_stopped(str(tmp_path / "stops")) == "1 of 1 ranks saved and stopped at step 3"
    monkeypatch.delenv(_stops.ENV)
    _stops.record(4, "x")  # not asked for: nothing is written, nothing raised


def test_a_stop_before_the_ranks_handle_signals_is_resumable(tmp_path: Path) -> None:
    """SIGUSR1 to ``unbroken run`` while the ranks behind a launcher have no handler yet
    (still importing): they die of it having trained nothing, the launcher exits 1, and the
    supervisor calls it a stop (75) -- under SLURM the job is requeued, not lost."""
    out = tmp_path / "rank"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UNBROKEN_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--json", str(tmp_path / "r.json"), "--"]
        + [sys.executable, "-c", AGENT, str(out), "ignore"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _wait([tmp_path / f"rank.ready.{r}" for r in range(2)])
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    (att,) = json.loads((tmp_path / "r.json").read_text())["attempts"]
    assert att["returncode"] == 1 and att["status"] == "resumable", att
    assert "before the ranks handled signals" in att["note"]
    assert att["signals"][0].startswith("SIGUSR1: forwarded to pids "), att
