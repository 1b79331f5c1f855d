"""kill -9 at every filesystem event of a save: the next start finds a complete checkpoint.

One driver process (``tests/_store_helpers.py``) commits checkpoint A (step 1), records the
events of saving step 2 (plus retention keep_last=1, whose deletions are events too), then forks
one child per event K that takes the writer lock and saves step 2 with ``UNBROKEN_FAULT=kill:K``
armed for that save only. This process then runs the start-up path on what each child left:
lock (taking over the dead child's), ``clean_stale()``, ``latest()``, restore into fresh objects.

Scenarios: ``new`` saves a new step 2; ``resave`` saves step 2 again over a committed step 2
(load, then save at once), which must replace it atomically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._logs import logged
from tests._store_helpers import REPO, assert_same, latest, load_snapshot, restore, transients
from unbroken.store import CheckpointStore, Retention, WriterLock

SCENARIOS = ["new", "resave"]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sweep"))
    driver = os.path.join(REPO, "tests", "_store_helpers.py")
    proc = subprocess.run(
        [sys.executable, driver, out], capture_output=True, text=True, timeout=240, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_recording_run_covers_every_stage(sweeps, scenario):
    sweep = sweeps[scenario]
    assert sweep["record"] == 0
    names = [e[1] for e in sweep["events"]]
    for stage in ("mkdir", "create", "write", "close", "fsync", "fsync_dir", "rename", "rmtree"):
        assert stage in names, f"no {stage} event in {names}"
    files = [e[2] for e in sweep["events"]]
    # retention (keep_last=1) deletes step 1 after the commit: rename to .del-*, then delete
    assert files.index("step-000000002") < files.index(".del-step-000000001")
    if scenario == "resave":
        assert ".old-step-000000002" in files  # the replaced copy is moved aside first


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_event_was_reached_and_killed(sweeps, scenario):
    sweep = sweeps[scenario]
    assert len(sweep["kills"]) == len(sweep["events"]) >= 20
    for res, ev in zip(sweep["kills"], sweep["events"], strict=True):
        k = res["k"]
        assert res["code"] == -9, f"K={k} ({ev}): child exited with {res['code']}, not SIGKILL"
        assert res["last"] == ev, f"K={k}: killed at {res['last']}, expected {ev}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_start_up_after_each_kill_finds_a_complete_checkpoint(sweeps, scenario):
    sweep = sweeps[scenario]
    out = sweep["out"]
    step1 = load_snapshot(os.path.join(out, "expect-1"))
    new = load_snapshot(os.path.join(out, "expect-2"))
    old = load_snapshot(os.path.join(out, "expect-2-old")) if scenario == "resave" else step1
    # the save commits at the rename of its temp dir to step-000000002
    commit = next(
        i for i, e in enumerate(sweep["events"], 1) if e[1:] == ["rename", "step-000000002"]
    )
    for res in sweep["kills"]:
        k, run = res["k"], res["run"]
        lock = WriterLock(run)
        with logged() as took_over:
            lock.acquire()
        try:
            assert any(f"pid {res['pid']}" in m for m in took_over), (k, took_over)
            store = CheckpointStore(run, Retention(keep_last=1))
            store.clean_stale()
            assert transients(run) == [], f"K={k}: left {transients(run)}"
            reader, warned = latest(store)
            assert warned == [], f"K={k}: {warned}"
            assert reader is not None, f"K={k}: no checkpoint found"
            committed = k > commit
            want_step = 2 if committed or scenario == "resave" else 1
            assert reader.step == want_step, f"K={k}: latest is step {reader.step}"
            assert_same(restore(reader), new if committed else old)
        finally:
            lock.release()
