"""In-memory snapshots at the store level: committed whole or not at all, persisted by copy.

A real second process takes snapshots and is SIGKILLed at every filesystem event of one
(``UNBROKEN_FAULT=kill:K``); the supervisor's :func:`persist` must then commit the previous
snapshot into the run directory, bit for bit, and a durable checkpoint newer than the snapshot
must win. A real small tmpfs (root only) stands in for a /dev/shm that is too small.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import unbroken
from tests._store_helpers import REPO, assert_same, make_registry, restore, save, snapshot, train
from unbroken.store import CheckpointStore
from unbroken.store.snapshot._area import SnapshotArea, persist

CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {repo!r})
    from tests._store_helpers import make_registry, train
    from tests import faults
    from unbroken.store import _fsops
    from unbroken.store.snapshot._area import SnapshotArea
    area = SnapshotArea(sys.argv[1])
    reg = make_registry()
    train(reg, 1)
    area.save(1, reg.collect(), {{"epoch": 0}})
    train(reg, 1)
    _fsops.set_hook(faults.hook("kill:" + sys.argv[2], os.environ.get(faults.LOG_ENV)))
    area.save(2, reg.collect(), {{"epoch": 0}})
    print("survived", flush=True)
    """
)


def _expected(steps: int):
    reg = make_registry()
    for _ in range(steps):
        train(reg, 1)  # as the child trains: one step per call (train seeds by the step)
    return _no_rng(snapshot(reg))


def _no_rng(snap):
    """The global RNG state is this process's (it differs from the child's); all else must not."""
    trees, tensors = snap
    return {k: {c: v for c, v in t.items() if c != "rng"} for k, t in trees.items()}, tensors


def test_area_is_private(tmp_path):
    area = SnapshotArea(str(tmp_path / "area"))
    assert os.stat(area.root).st_mode & 0o777 == 0o700


def _kill_points(script, tmp_path) -> list[int]:
    """Events of one snapshot (a logged dry run): the first, every one around the commit
    point (the rename of .tmp-step-2), and the retention deletion of step 1 after it."""
    log = tmp_path / "events.log"
    env = {**os.environ, "UNBROKEN_FAULT_LOG": str(log)}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "dry"), "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "survived" in proc.stdout, proc.stderr[-2000:]
    events = [line.split("\t") for line in log.read_text().splitlines()]
    first_of_2 = next(int(n) for n, ev, name in events if name.endswith("step-000000002"))
    commit = next(int(n) for n, ev, name in events if ev == "rename" and name == "step-000000002")
    return sorted({first_of_2, commit - 1, commit, commit + 1, int(events[-1][0])})


def test_a_kill_during_a_snapshot_persists_the_previous_one(tmp_path):
    one, two = _expected(1), _expected(2)
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=REPO))
    kept = {}
    for k in _kill_points(script, tmp_path):
        area, run = tmp_path / f"area{k}", tmp_path / f"run{k}"
        proc = subprocess.run(
            [sys.executable, str(script), str(area), str(k)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -9, (k, proc.stdout, proc.stderr[-2000:])
        step = persist(str(area), str(run))
        reader = CheckpointStore(str(run)).latest()
        assert reader is not None and reader.step == step
        # Killed before the new snapshot's commit point: the previous one is what is kept.
        assert_same(_no_rng(restore(reader)), two if step == 2 else one)
        kept[k] = step
    ks = sorted(kept)
    # An event is announced before its operation: a kill at the commit rename is before it.
    assert [kept[k] for k in ks] == [1, 1, 1, 2, 2], kept


def test_a_newer_durable_checkpoint_wins(tmp_path):
    area = SnapshotArea(str(tmp_path / "area"))
    reg = make_registry()
    train(reg, 1)
    area.save(1, reg.collect(), {"epoch": 0})
    run = str(tmp_path / "run")
    train(reg, 1)
    save(CheckpointStore(run), reg)  # durable step 2
    assert persist(area.root, run) is None
    assert [r.step for r in CheckpointStore(run).listing()] == [2]


def test_the_area_keeps_one_complete_snapshot(tmp_path):
    area = SnapshotArea(str(tmp_path / "area"))
    reg = make_registry()
    for step in range(1, 5):
        train(reg, 1)
        area.save(step, reg.collect(), {"epoch": 0})
    assert sorted(os.listdir(os.path.join(area.root, "checkpoints"))) == ["step-000000004"]


def test_a_too_small_shared_memory_turns_snapshots_off(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        area = SnapshotArea(str(mnt / "area"))
        assert area.fits(100 << 10) is True
        assert area.fits(8 << 20) is False
        assert "durable saves only" in (area.disabled or "") and str(mnt) in area.disabled
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _snapshotting_run(run_dir, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = unbroken.Run(
        str(run_dir),
        model=model,
        optimizer=opt,
        save_every=2,
        snapshot_every=1,
        handle_signals=False,
        progress=False,
        **kw,
    )
    return run, model, opt


def _steps(run, model, opt, n):
    for _ in range(n):
        g = torch.Generator().manual_seed(run.counters.step)
        model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        run.step(loss=float(run.counters.step))


def test_a_snapshot_the_supervisor_did_not_keep_is_kept_by_the_next_trainer(tmp_path, monkeypatch):
    """The trainer died after step 5 (durable: step 4; in memory: step 5) and its supervisor
    could not keep the snapshot: the next trainer given the same area commits it into the run
    directory itself, as the supervisor would have, and continues from step 5 -- exactly."""
    area = tmp_path / "area"
    area.mkdir(mode=0o700)
    ref, ref_model, ref_opt = _snapshotting_run(tmp_path / "ref")
    _steps(ref, ref_model, ref_opt, 7)
    ref.close()
    monkeypatch.setenv("UNBROKEN_SNAPSHOT_DIR", str(area))
    run, model, opt = _snapshotting_run(tmp_path / "run")
    _steps(run, model, opt, 5)
    run.close()  # as if it had died: close() saves nothing
    assert [s for s, _ in unbroken.store.scan(str(tmp_path / "run"))] == [4, 2]
    run, model, opt = _snapshotting_run(tmp_path / "run")
    assert run.resumed_from == 5
    assert [s for s, _ in unbroken.store.scan(str(tmp_path / "run"))] == [5, 4, 2]
    CheckpointStore(str(tmp_path / "run")).open(5).verify()  # a verified, committed copy
    _steps(run, model, opt, 2)
    run.close()
    assert torch.equal(model.weight, ref_model.weight)
    assert unbroken.read_metrics(str(tmp_path / "run")) == unbroken.read_metrics(
        str(tmp_path / "ref")
    )
