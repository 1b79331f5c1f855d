"""Snapshots taken as ``Run`` takes them in one process: the copy into the slot blocks, the hash
and the commit run in a thread (``SnapshotArea.save_later``) until ``settle()``.

The live state moves on while the thread commits: the snapshot must still be the state at the
copy, bit for bit. A real second process SIGKILLed at each filesystem event of the background
commit must leave the previous snapshot for :func:`persist`; an error of the thread is raised
by ``settle()``, and the next snapshot goes on.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap

import pytest

from tests._store_helpers import REPO, assert_same, make_registry, restore, train
from tests.test_snapshot import _expected, _no_rng
from unbroken import CheckpointWriteError
from unbroken.store import CheckpointStore, _fsops
from unbroken.store._snapshot import SnapshotArea, persist

CHILD = textwrap.dedent(
    """
    import os, sys, threading
    sys.path.insert(0, {repo!r})
    from tests._store_helpers import make_registry, train
    from unbroken.store import _fsops
    from unbroken.store._snapshot import SnapshotArea
    area, nth = SnapshotArea(sys.argv[1]), int(sys.argv[2])
    reg = make_registry()
    train(reg, 1)
    area.save_later(1, reg.collect(), {{"epoch": 0}})
    area.settle()
    train(reg, 1)
    seen = []
    def hook(ev, path):
        if threading.current_thread().name == "unbroken-snapshot":
            seen.append(ev)
            if len(seen) == nth:
                os.kill(os.getpid(), 9)
    _fsops.set_hook(hook)
    area.save_later(2, reg.collect(), {{"epoch": 0}})
    train(reg, 1)  # the live state moves on while the thread commits
    area.settle()
    print("events", len(seen), flush=True)
    """
)


def _child(tmp_path, area, nth: int) -> subprocess.CompletedProcess:
    script = tmp_path / "background_child.py"
    script.write_text(CHILD.format(repo=REPO))
    return subprocess.run(
        [sys.executable, str(script), str(area), str(nth)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_snapshot_is_the_state_at_the_copy(tmp_path):
    area, run = SnapshotArea(str(tmp_path / "area")), tmp_path / "run"
    reg = make_registry()
    train(reg, 1)
    area.save_later(1, reg.collect(), {"epoch": 0})
    train(reg, 1)  # changes every live tensor while the thread hashes and commits
    area.settle()
    assert persist(area.root, str(run)) == 1
    assert_same(_no_rng(restore(CheckpointStore(str(run)).latest())), _expected(1))


def test_a_kill_during_the_background_commit_keeps_the_previous_snapshot(tmp_path):
    done = _child(tmp_path, tmp_path / "probe", nth=0)
    assert done.returncode == 0, done.stderr
    events = int(done.stdout.split()[-1])
    assert events >= 5  # write, create/close of the JSON files, fsyncs, rename, ...
    # The first and last events (the copy's write, the rename) and three between; each kill
    # costs a fresh interpreter.
    for nth in sorted({1, 2, events // 2, events - 1, events}):
        area, run = tmp_path / f"area{nth}", tmp_path / f"run{nth}"
        proc = _child(tmp_path, area, nth)
        assert proc.returncode == -9, (nth, proc.stdout, proc.stderr)
        kept = persist(str(area), str(run))
        assert kept in (1, 2), nth  # the rename is the last event: after it, step 2 is whole
        assert_same(_no_rng(restore(CheckpointStore(str(run)).latest())), _expected(kept))


def test_an_error_of_the_thread_is_raised_by_settle_and_the_next_one_works(tmp_path):
    area = SnapshotArea(str(tmp_path / "area"))
    reg = make_registry()
    train(reg, 1)

    def full(ev, path):
        if ev == "create" and path.endswith("manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device", path)

    old = _fsops.set_hook(full)
    try:
        area.save_later(1, reg.collect(), {"epoch": 0})
        with pytest.raises(CheckpointWriteError, match="disk is full"):
            area.settle()
    finally:
        _fsops.set_hook(old)
    area.settle()  # raised once, then cleared
    train(reg, 1)
    area.save_later(2, reg.collect(), {"epoch": 0})
    area.settle()
    assert persist(area.root, str(tmp_path / "run")) == 2
    assert_same(_no_rng(restore(CheckpointStore(str(tmp_path / "run")).latest())), _expected(2))
