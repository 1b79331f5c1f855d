"""No file outside the run is touched, and nothing planted in the run can hang or crash it.

Real symlinks pointing at a file outside the run (which must stay byte-identical), real FIFOs
(every open that could hang runs in a child process with a timeout), a real second process
holding the lock, a lock file deleted or replaced under a live holder, and stale locks with
odd JSON in them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import unbroken
from tests._store_helpers import REPO, deadline
from unbroken import LockError
from unbroken.errors import UnsafeCheckpointError
from unbroken.process._logfile import last_logged_step
from unbroken.store import CheckpointStore, WriterLock

SECRET = b"precious bytes outside the run\n" * 10


def outside(tmp_path: Path) -> Path:
    target = tmp_path / "outside.txt"
    target.write_bytes(SECRET)
    return target


def new_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    return run


def child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


_START = """
import sys, torch, unbroken
try:
    unbroken.Run(sys.argv[1], model=torch.nn.Linear(2, 2), progress=False)
except unbroken.UnbrokenError as e:
    print(type(e).__name__, e)
    sys.exit(3)
print("started")
"""


@pytest.mark.parametrize("name", [".unbroken.lock", "metrics.jsonl"])
def test_a_symlink_in_the_run_is_refused_and_its_target_untouched(tmp_path, name):
    run, target = new_run(tmp_path), outside(tmp_path)
    (run / name).symlink_to(target)
    with pytest.raises(UnsafeCheckpointError) as ei:
        unbroken.Run(run, model=torch.nn.Linear(2, 2), progress=False)
    msg = str(ei.value)
    assert str(run / name) in msg and "symbolic link" in msg, msg
    assert target.read_bytes() == SECRET
    assert os.path.islink(run / name)  # left for the user to look at, not followed
    # The failed start released the lock: with the link gone the run starts.
    os.remove(run / name)
    unbroken.Run(run, model=torch.nn.Linear(2, 2), progress=False).close()


@pytest.mark.parametrize("name", [".unbroken.lock", "metrics.jsonl"])
def test_a_fifo_in_the_run_does_not_hang_the_start(tmp_path, name):
    run = new_run(tmp_path)
    os.mkfifo(run / name)
    with deadline(20), pytest.raises(UnsafeCheckpointError) as ei:  # a hang fails, too
        unbroken.Run(run, model=torch.nn.Linear(2, 2), progress=False)
    assert str(run / name) in str(ei.value) and "FIFO" in str(ei.value), str(ei.value)


def test_read_metrics_refuses_a_fifo_and_a_symlink_without_hanging(tmp_path):
    run = new_run(tmp_path)
    os.mkfifo(run / "metrics.jsonl")
    with deadline(20), pytest.raises(UnsafeCheckpointError, match="FIFO"):
        unbroken.read_metrics(run)
    with deadline(20):
        assert last_logged_step(run) == 0  # what `unbroken demo` polls while a run trains
    os.remove(run / "metrics.jsonl")
    (run / "metrics.jsonl").symlink_to(outside(tmp_path))
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        unbroken.read_metrics(run)


def test_a_directory_at_the_lock_path_is_a_clear_error(tmp_path):
    run = new_run(tmp_path)
    (run / ".unbroken.lock").mkdir()
    with pytest.raises((UnsafeCheckpointError, LockError)) as ei:
        WriterLock(str(run)).acquire()
    assert str(run / ".unbroken.lock") in str(ei.value)


_HOLDER = """
import json, os, sys, time
from unbroken.store import WriterLock
lock = WriterLock(sys.argv[1])
lock.acquire()
if len(sys.argv) > 2:  # write an odd identity into the lock file (what a stranger could)
    os.ftruncate(lock._fd, 0)
    os.pwrite(lock._fd, sys.argv[2].encode(), 0)
print("locked", flush=True)
time.sleep(120)
"""


def _holder(run: Path, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run), *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_deleted_or_replaced_lock_file_lets_no_second_writer_in(tmp_path, how):
    run = new_run(tmp_path)
    holder = _holder(run)
    try:
        lock_path = run / ".unbroken.lock"
        if how == "deleted":
            os.remove(lock_path)
        else:
            (run / "other").write_text("")
            os.replace(run / "other", lock_path)
        with pytest.raises(LockError, match="is being written by"):
            WriterLock(str(run)).acquire()
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait(timeout=30)
    lock = WriterLock(str(run))  # the holder is gone: free again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lock.acquire()
    lock.release()


def test_the_holder_puts_a_deleted_lock_file_back_and_refuses_a_replaced_one(tmp_path):
    run = new_run(tmp_path)
    lock = WriterLock(str(run))
    lock.acquire()
    try:
        os.remove(lock.path)
        lock.check()  # at the next save: put back, with our identity
        with open(lock.path) as f:
            assert json.load(f)["pid"] == os.getpid()
        other = run / "other"
        other.write_text('{"pid": 1}')
        os.replace(other, lock.path)
        with pytest.raises(LockError, match="was replaced"):
            lock.check()
    finally:
        lock.release()


ODD = [
    '{"pid": 7, "since": "x"}',
    '{"since": 1e300}',
    "[1, 2]",
    '{"pid": [1], "since": -1e300}',
    '{"since": NaN, "host": {"a": 1}}',
    "not json at all",
    '{"pid": 1' + ', "x": 1' * 2000 + "}",
]


@pytest.mark.parametrize("content", ODD, ids=range(len(ODD)))
def test_odd_json_in_a_stale_lock_never_crashes_the_start(tmp_path, content):
    run = new_run(tmp_path)
    (run / ".unbroken.lock").write_text(content)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "took over the lock left by ..." where it parses
        unbroken.Run(run, model=torch.nn.Linear(2, 2), progress=False).close()


def test_odd_json_in_a_live_lock_still_gives_a_clear_lock_error(tmp_path):
    run = new_run(tmp_path)
    holder = _holder(run, '{"pid": 12, "host": "h", "since": 1e300}')
    try:
        with pytest.raises(LockError) as ei:
            WriterLock(str(run)).acquire()
        assert "pid 12 on host h (since unknown time)" in str(ei.value), str(ei.value)
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_planted_tmp_symlink_is_removed_not_followed(tmp_path):
    run = tmp_path / "run"
    first = unbroken.Run(run, model=torch.nn.Linear(2, 2), progress=False, max_steps=10)
    first.step()
    first.save()
    first.close()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_bytes(SECRET)
    planted = run / "checkpoints" / ".tmp-step-000000002"
    planted.symlink_to(victim, target_is_directory=True)
    # 1. clean-up at start-up removes the link only.
    removed = CheckpointStore(str(run)).clean_stale()
    assert str(planted) in removed and not os.path.lexists(planted)
    assert (victim / "keep.txt").read_bytes() == SECRET
    # 2. planted again while the run is live: the save of that step removes the link and saves.
    r = unbroken.Run(run, model=torch.nn.Linear(2, 2), progress=False, max_steps=10)
    planted.symlink_to(victim, target_is_directory=True)
    r.step()
    path = r.save()
    r.close()
    assert path.endswith("step-000000002") and os.path.isdir(path) and not os.path.islink(path)
    assert sorted(os.listdir(victim)) == ["keep.txt"]
    assert (victim / "keep.txt").read_bytes() == SECRET
    assert CheckpointStore(str(run)).latest().step == 2


def test_a_lock_file_symlink_never_truncates_its_target_even_for_a_second_start(tmp_path):
    # The defect: the lock was opened O_CREAT|O_RDWR following links and then truncated.
    run, target = new_run(tmp_path), outside(tmp_path)
    (run / ".unbroken.lock").symlink_to(target)
    for _ in range(2):
        proc = child(_START, str(run))
        assert proc.returncode == 3 and "symbolic link" in proc.stdout, (proc.stdout, proc.stderr)
    assert target.read_bytes() == SECRET


def test_pin_does_not_write_through_a_planted_symlink(tmp_path):
    run = tmp_path / "run"
    r = unbroken.Run(run, model=torch.nn.Linear(2, 2), progress=False, max_steps=10)
    r.step()
    r.save()
    r.close()
    target = outside(tmp_path)
    marker = run / "checkpoints" / "step-000000001" / ".pinned"
    marker.symlink_to(target)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        CheckpointStore(str(run)).pin(1)
    assert target.read_bytes() == SECRET
    CheckpointStore(str(run)).pin(1, False)  # unpinning removes the link, not the target
    assert not os.path.lexists(marker) and target.read_bytes() == SECRET
