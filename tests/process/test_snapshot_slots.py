"""The snapshot area's two fixed slots (store/snapshot/_slots.py): overwritten in place, never the
one the newest snapshot links.

A real second process is SIGKILLed in the middle of copying a snapshot into a slot that held
an earlier one (the third snapshot reuses the first one's slot), in the process that wrote the
earlier snapshots and in a fresh one (a relaunch, which finds the slot in use on disk): the
supervisor's :func:`persist` must commit the previous snapshot, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests._store_helpers import REPO, assert_same, make_registry, restore, snapshot, train
from tests.process.test_snapshot import _expected, _no_rng
from unbroken.store import CheckpointStore
from unbroken.store.snapshot._area import SnapshotArea, persist

CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {repo!r})
    from tests._store_helpers import make_registry, train
    from unbroken.store import _fsops
    from unbroken.store.snapshot._area import SnapshotArea
    root, upto, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    area = SnapshotArea(root)
    reg = make_registry()
    for step in range(1, upto + 1):
        train(reg, 1)
        if step == kill_at:
            def hook(ev, path):
                if ev == "write" and os.sep + "slots" + os.sep in path:
                    os.kill(os.getpid(), 9)  # the slot is partly overwritten
            _fsops.set_hook(hook)
        if step >= int(sys.argv[4]):
            area.save(step, reg.collect(), {{"epoch": 0}})
    print("survived", flush=True)
    """
)


def _child(tmp_path, area, upto: int, kill_at: int, first: int = 1) -> int:
    script = tmp_path / "slots_child.py"
    script.write_text(CHILD.format(repo=REPO))
    proc = subprocess.run(
        [sys.executable, str(script), str(area), str(upto), str(kill_at), str(first)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode


def test_a_kill_while_reusing_a_slot_persists_the_previous_snapshot(tmp_path):
    area, run = tmp_path / "area", tmp_path / "run"
    assert _child(tmp_path, area, 3, kill_at=3) == -9
    assert persist(str(area), str(run)) == 2
    assert_same(_no_rng(restore(CheckpointStore(str(run)).latest())), _expected(2))


def test_a_relaunch_does_not_overwrite_the_newest_snapshot(tmp_path):
    area, run = tmp_path / "area", tmp_path / "run"
    assert _child(tmp_path, area, 2, kill_at=0) == 0  # snapshots 1 and 2, clean exit
    # A new process: it trains 3 steps, snapshots only the third, killed while copying it.
    assert _child(tmp_path, area, 3, kill_at=3, first=3) == -9
    assert persist(str(area), str(run)) == 2
    assert_same(_no_rng(restore(CheckpointStore(str(run)).latest())), _expected(2))


def test_slots_are_reused_and_follow_a_changed_layout(tmp_path):
    area = SnapshotArea(str(tmp_path / "area"))
    reg = make_registry()
    for step in range(1, 6):
        train(reg, 1)
        area.save(step, reg.collect(), {"epoch": 0})
    assert sorted(os.listdir(os.path.join(area.root, "slots"))) == [
        "tensors-r00000.bin.0",
        "tensors-r00000.bin.1",
    ]
    reader = CheckpointStore(area.root).latest()
    assert reader is not None and reader.step == 5
    assert_same(restore(reader), snapshot(reg))
    # Another state (no optimizer moments yet: other tensors) into the same area, twice, so
    # that both slots are laid out anew.
    other = make_registry(seed=1)
    area.save(6, other.collect(), {"epoch": 0})
    area.save(7, other.collect(), {"epoch": 0})
    got = CheckpointStore(area.root).latest()
    assert got is not None and got.step == 7
    assert_same(restore(got), snapshot(other))
    area.close()


def test_a_newer_snapshot_from_a_left_history_is_dropped(tmp_path):
    area = SnapshotArea(str(tmp_path / "area"))
    reg = make_registry()
    train(reg, 1)
    area.save(9, reg.collect(), {"epoch": 0})
    area.save(4, reg.collect(), {"epoch": 0})  # resumed an earlier step
    assert os.listdir(os.path.join(area.root, "checkpoints")) == ["step-000000004"]
