"""Every write error keeps its cause, on a real full disk: a tmpfs mounted by the test.

Out of space in the middle of a tensor file, the writer's own error while unwinding is what
propagates; the ENOSPC survives only in its chain. The user must see the ENOSPC, with the file
that was being written, as a CheckpointWriteError (``errno``, ``path``, ``step``), and the
previous checkpoint must still load. A disk full before ``Run()`` starts fails on the lock file,
which must be named too. An async save's failure is never lost: raised at the next step, and
when the loop is left with ``break`` (skipping ``finish()``) the process exits non-zero.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import unbroken
from tests._store_helpers import REPO, latest, transients
from unbroken.errors import CheckpointWriteError, root_oserror
from unbroken.state import Counters, Registry
from unbroken.store import CheckpointStore


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A real 2 MiB tmpfs, mounted for the test and unmounted after it."""
    if os.geteuid() != 0:
        print("SKIP: mounting a tmpfs needs root; the full-disk tests did not run")
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        print(f"SKIP: cannot mount a tmpfs here: {proc.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` up to ``leave`` free bytes (with a real file); returns the file."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 65536):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
    size = os.path.getsize(filler)
    os.truncate(filler, max(0, size - leave))
    return filler


def registry(n: int) -> Registry:
    reg = Registry()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reg.add("model", torch.nn.Linear(n, n))
    reg.add("counters", Counters())
    return reg


def test_full_disk_mid_write_is_enospc_naming_the_file(small_disk):
    run = str(small_disk / "run")
    store = CheckpointStore(run)
    small = registry(4)
    store.save(1, small.collect(), {})
    fill(small_disk, leave=300_000)
    big = registry(512)  # 1 MiB of weights: the disk fills in the middle of the tensor file
    with pytest.raises(CheckpointWriteError) as ei:
        store.save(2, big.collect(), {})
    err = ei.value
    assert err.errno == errno.ENOSPC, (err.errno, str(err), repr(err.__cause__))
    assert err.step == 2
    tmp = os.path.join(run, "checkpoints", ".tmp-step-000000002")
    assert err.path is not None and err.path.startswith(tmp + os.sep), err.path
    assert err.filename == err.path
    assert err.path in str(err) and "No space left on device" in str(err), str(err)
    inner = root_oserror(err)
    assert inner is not None and inner.errno == errno.ENOSPC
    assert transients(run) == []
    reader, warned = latest(CheckpointStore(run))
    assert warned == [] and reader is not None and reader.step == 1


def test_full_disk_before_the_run_starts_names_the_lock_file(small_disk):
    run = small_disk / "run"
    run.mkdir()
    fill(small_disk, leave=0)
    with pytest.raises(CheckpointWriteError) as ei:
        unbroken.Run(run, model=torch.nn.Linear(2, 2), progress=False)
    err = ei.value
    assert err.errno == errno.ENOSPC
    assert err.path == str(run / ".unbroken.lock")
    assert str(run / ".unbroken.lock") in str(err) and "disk is full" in str(err), str(err)


def test_async_save_failure_on_a_full_disk_is_raised_at_the_next_step(small_disk):
    run = small_disk / "run"
    r = unbroken.Run(
        run, model=torch.nn.Linear(512, 512), async_save=True, metrics=False, progress=False
    )
    fill(small_disk, leave=300_000)
    r.step()
    r.save()  # snapshot now; the write fails in the background
    r._checkpointer.background._thread.join()  # type: ignore[union-attr]
    with pytest.raises(CheckpointWriteError) as ei:
        r.step()
    assert ei.value.errno == errno.ENOSPC and ei.value.step == 1, str(ei.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r.close()


_BREAKS = r"""
import sys, torch, unbroken
from tests import faults
faults.install_from_env()
run = unbroken.Run(sys.argv[1], model=torch.nn.Linear(4, 4), async_save=True, save_every=3,
                   max_steps=100, progress=False)
for batch in run.loop(range(1000)):
    if run.step():
        break
    if run.counters.step == 3:
        print("left the loop after step 3", flush=True)
        break  # finish() never runs; the save of step 3 is still in flight
"""


@pytest.mark.parametrize("fault", ["errno:ENOSPC:fsync:1", "errno:EIO:rename:1"])
def test_break_out_of_the_loop_while_the_async_save_fails_exits_non_zero(tmp_path, fault):
    """A real process leaves the loop with ``break`` while its background save fails
    (fault injection in the save thread): exit 1 and the error on stderr, never exit 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "UNBROKEN_FAULT": fault}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_BREAKS), str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "left the loop after step 3" in proc.stdout, proc.stderr
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    code = fault.split(":")[1]
    assert "background save of step 3 failed" in proc.stderr, proc.stderr
    assert os.strerror(getattr(errno, code)) in proc.stderr, proc.stderr
    assert CheckpointStore(str(tmp_path / "run")).latest() is None
    if "EIO" in fault:
        return
    # Without the fault the same script exits 0 and the checkpoint is committed.
    env.pop("UNBROKEN_FAULT")
    ok = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_BREAKS), str(tmp_path / "ok")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    reader = CheckpointStore(str(tmp_path / "ok")).latest()
    assert reader is not None and reader.step == 3


def test_torch_zip_writer_unwinding_on_a_full_disk_still_reads_as_enospc(small_disk):
    """torch.save onto a full disk fails with "unexpected pos" (the ENOSPC only in its chain);
    DCP wraps it per rank in CheckpointException, and a wrapper may re-raise ``from None``:
    the ENOSPC and its file are still what the save reports."""
    from torch.distributed.checkpoint.api import CheckpointException

    from unbroken import CorruptCheckpointError
    from unbroken.errors import write_error as _write_error
    from unbroken.store import _fsops

    fill(small_disk, leave=100_000)
    path = str(small_disk / "t.pt")
    with pytest.raises(BaseException) as raised:
        with _fsops.HashingWriter(path) as w:
            torch.save(torch.zeros(200_000), w)
    try:
        try:
            raise CheckpointException("save failed", {0: (raised.value, None)})
        except CheckpointException as e:
            raise CorruptCheckpointError(f"torch.distributed.checkpoint failed: {e}") from None
    except CorruptCheckpointError as wrapped:
        err = _write_error(wrapped, str(small_disk / ".tmp-step-000000007"), 7, str(small_disk))
    assert isinstance(err, CheckpointWriteError), repr(err)
    assert err.errno == errno.ENOSPC and err.step == 7, str(err)
    assert "No space left on device" in str(err)
