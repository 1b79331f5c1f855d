"""Retention deletes only our committed checkpoints, only after a commit, and never the kept ones;
clean_stale finishes or undoes what a killed save or deletion left behind."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from tests._store_helpers import (
    assert_same,
    ckpt,
    entries,
    fail_at_event,
    hook,
    latest,
    make_registry,
    make_run,
    recorder,
    restore,
    save,
    snapshot,
    train,
    transients,
)
from unbroken import ConfigError
from unbroken.errors import CheckpointNotFoundError, CheckpointWriteError
from unbroken.store import CheckpointStore, Retention


def run_steps(run: str, steps: range, retention: Retention, pin: tuple[int, ...] = ()) -> dict:
    """Save at each step and apply retention after each save, as the training loop does."""
    reg = make_registry()
    store = CheckpointStore(run, retention)
    snaps = {}
    for s in steps:
        train(reg, s - reg.get("counters").step)
        save(store, reg)
        snaps[s] = snapshot(reg)
        if s in pin:
            store.pin(s)
        store.apply_retention(s)
    return snaps


def steps_on_disk(run: str) -> list[int]:
    return [int(e.removeprefix("step-")) for e in entries(run) if e.startswith("step-")]


def test_keep_last_two(tmp_path):
    run = str(tmp_path)
    snaps = run_steps(run, range(1, 6), Retention(keep_last=2))
    assert steps_on_disk(run) == [4, 5]
    assert transients(run) == []
    store = CheckpointStore(run)
    assert_same(restore(store.open(4)), snaps[4])
    assert_same(restore(store.open(5)), snaps[5])


def test_keep_last_never_counts_a_damaged_checkpoint(tmp_path):
    # keep_last=2 keeps the new checkpoint and one intact older one: a truncated checkpoint 4
    # must not stand in for it, so 3 survives (and 4 is kept while it is the newer one).
    run = str(tmp_path)
    snaps = run_steps(run, range(1, 5), Retention(keep_last=2))
    assert steps_on_disk(run) == [3, 4]
    data = next(f for f in os.listdir(ckpt(run, 4)) if f.endswith(".bin"))
    with open(os.path.join(ckpt(run, 4), data), "r+b") as f:
        f.truncate(10)
    save_at(run, 5, Retention(keep_last=2))
    assert steps_on_disk(run) == [3, 4, 5]
    assert_same(restore(CheckpointStore(run).open(3)), snaps[3])
    save_at(run, 6, Retention(keep_last=2))
    assert steps_on_disk(run) == [5, 6]


def save_at(run: str, step: int, retention: Retention) -> None:
    """A save of step ``step`` (a fresh registry trained that far), then retention."""
    reg = make_registry()
    train(reg, step)
    store = CheckpointStore(run, retention)
    save(store, reg)
    store.apply_retention(step)


def test_keep_every(tmp_path):
    run = str(tmp_path)
    run_steps(run, range(1, 8), Retention(keep_last=1, keep_every=3))
    assert steps_on_disk(run) == [3, 6, 7]


def test_keep_all(tmp_path):
    run = str(tmp_path)
    run_steps(run, range(1, 4), Retention(keep_last=None))
    assert steps_on_disk(run) == [1, 2, 3]


def test_pinned_is_kept_until_unpinned(tmp_path):
    run = str(tmp_path)
    run_steps(run, range(1, 5), Retention(keep_last=1), pin=(2,))
    assert steps_on_disk(run) == [2, 4]
    store = CheckpointStore(run, Retention(keep_last=1))
    assert [x.step for x in store.listing() if x.pinned] == [2]
    store.pin(2, False)
    assert store.apply_retention(4) == [2]
    assert steps_on_disk(run) == [4]
    with pytest.raises(CheckpointNotFoundError):
        store.pin(3)


def test_bad_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="keep_last"):
        Retention(keep_last=0)
    with pytest.raises(ConfigError, match="keep_every"):
        Retention(keep_every=0)


def test_failed_save_leaves_the_last_good_checkpoints(tmp_path):
    run = str(tmp_path)
    snaps = run_steps(run, range(1, 3), Retention(keep_last=2))
    reg = make_registry(seed=5)
    train(reg, 3)
    store = CheckpointStore(run, Retention(keep_last=2))
    reached: list[str] = []
    with hook(fail_at_event("write", errno.ENOSPC, reached)):
        with pytest.raises(CheckpointWriteError, match="No space left"):
            save(store, reg)
    assert reached
    # the loop applies retention only after a commit; even if asked, it keeps the newest good
    store.apply_retention(2)
    assert steps_on_disk(run) == [1, 2]
    assert transients(run) == []
    reader, _ = latest(store)
    assert reader is not None and reader.step == 2
    assert_same(restore(reader), snaps[2])


def test_directories_that_are_not_ours_are_never_deleted(tmp_path):
    run = str(tmp_path)
    root = os.path.join(run, "checkpoints")
    os.makedirs(os.path.join(root, "step-000000001"))  # a user's copy: no manifest
    with open(os.path.join(root, "step-000000001", "weights.pt"), "wb") as f:
        f.write(b"user data")
    os.makedirs(os.path.join(root, "notes"))
    with open(os.path.join(root, "notes", "todo.txt"), "w") as f:
        f.write("keep me")
    with open(os.path.join(root, "step-000000000.bak"), "w") as f:
        f.write("a file")
    run_steps(run, range(2, 6), Retention(keep_last=1))
    store = CheckpointStore(run, Retention(keep_last=1))
    assert store.clean_stale() == []
    assert store.apply_retention(5) == []
    assert entries(run) == ["notes", "step-000000000.bak", "step-000000001", "step-000000005"]
    assert os.listdir(os.path.join(root, "step-000000001")) == ["weights.pt"]
    assert os.listdir(os.path.join(root, "notes")) == ["todo.txt"]


def test_retention_events_come_after_the_commit(tmp_path):
    run = str(tmp_path)
    run_steps(run, range(1, 2), Retention(keep_last=1))
    events: list[tuple[str, str]] = []
    with hook(recorder(events)):
        run_steps_from(run, 2)
    names = [(e, os.path.basename(p)) for e, p in events]
    commit = names.index(("rename", "step-000000002"))
    assert names.index(("rename", ".del-step-000000001")) > commit
    assert names[-1] == ("rmtree", ".del-step-000000001")
    assert steps_on_disk(run) == [2]


def run_steps_from(run: str, step: int) -> None:
    reg = make_registry()
    train(reg, step)
    store = CheckpointStore(run, Retention(keep_last=1))
    save(store, reg)
    store.apply_retention(step)


def test_clean_stale_removes_leftovers_of_killed_saves_and_deletions(tmp_path):
    run = str(tmp_path)
    snaps = make_run(run, (1, 2))
    root = os.path.join(run, "checkpoints")
    os.makedirs(os.path.join(root, ".tmp-step-000000003"))  # a save killed midway
    shutil.copytree(ckpt(run, 1), os.path.join(root, ".del-step-000000001"))  # a deletion
    store = CheckpointStore(run)
    removed = sorted(os.path.basename(p) for p in store.clean_stale())
    assert removed == [".del-step-000000001", ".tmp-step-000000003"]
    assert entries(run) == ["step-000000001", "step-000000002"]
    assert_same(restore(store.latest()), snaps[2])


def test_clean_stale_puts_back_a_copy_moved_aside_by_a_killed_resave(tmp_path):
    """Killed between moving step 2 aside (.old-) and renaming its new copy in."""
    run = str(tmp_path)
    snaps = make_run(run, (1, 2))
    root = os.path.join(run, "checkpoints")
    os.rename(ckpt(run, 2), os.path.join(root, ".old-step-000000002"))
    shutil.copytree(ckpt(run, 1), os.path.join(root, ".tmp-step-000000002"))
    store = CheckpointStore(run)
    reader, _ = latest(store)
    assert reader is not None and reader.step == 1  # without clean_stale step 2 is hidden
    store.clean_stale()
    assert entries(run) == ["step-000000001", "step-000000002"]
    reader, _ = latest(store)
    assert reader is not None and reader.step == 2
    assert_same(restore(reader), snaps[2])


def test_clean_stale_drops_the_replaced_copy_once_the_new_one_is_in(tmp_path):
    """Killed after the new copy of step 2 was renamed in, before the old one was removed."""
    run = str(tmp_path)
    snaps = make_run(run, (1, 2))
    root = os.path.join(run, "checkpoints")
    shutil.copytree(ckpt(run, 1), os.path.join(root, ".old-step-000000002"))
    CheckpointStore(run).clean_stale()
    assert entries(run) == ["step-000000001", "step-000000002"]
    assert_same(restore(CheckpointStore(run).open(2)), snaps[2])


def test_resaving_a_step_replaces_it(tmp_path):
    run = str(tmp_path)
    make_run(run, (1, 2))
    reg = make_registry(seed=9)
    train(reg, 4)
    reg.get("counters").step = 2
    events: list[tuple[str, str]] = []
    with hook(recorder(events)):
        CheckpointStore(run).save(2, reg.collect(), {})
    renames = [os.path.basename(p) for e, p in events if e == "rename"]
    assert renames[-2:] == [".old-step-000000002", "step-000000002"]
    assert ("rmtree", os.path.join(run, "checkpoints", ".old-step-000000002")) in events
    assert entries(run) == ["step-000000001", "step-000000002"]
    assert_same(restore(CheckpointStore(run).open(2)), snapshot(reg))
