"""Two writers: the second fails fast naming the first; a killed holder's lock is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests._logs import logged
from tests._store_helpers import REPO
from unbroken import LockError
from unbroken.store import WriterLock

_HOLDER = """
import sys, time
from unbroken.store import WriterLock
lock = WriterLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
time.sleep(300)
"""


def test_second_writer_fails_fast_then_takes_over_from_a_killed_holder(tmp_path):
    run = str(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, run], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        start = time.monotonic()
        with pytest.raises(LockError) as ei:
            WriterLock(run).acquire()
        # Failing fast is ~1 ms; a waiting acquire would block for as long as the holder
        # lives (60 s+). 10 s tells them apart on a loaded machine.
        assert time.monotonic() - start < 10.0, "acquire waited instead of failing fast"
        assert f"pid {holder.pid}" in str(ei.value)
        assert run in str(ei.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL

    lock = WriterLock(run)
    with logged() as msgs:
        lock.acquire()
    try:
        assert lock.held
        assert any("took over" in m and f"pid {holder.pid}" in m for m in msgs), msgs
        assert lock.previous is not None and lock.previous["pid"] == holder.pid
    finally:
        lock.release()


def test_same_process_second_lock_fails_and_release_is_clean(tmp_path):
    run = str(tmp_path)
    first = WriterLock(run)
    first.acquire()
    try:
        with pytest.raises(LockError, match=f"pid {os.getpid()}"):
            WriterLock(run).acquire()
    finally:
        first.release()
    assert not first.held
    again = WriterLock(run)
    with logged() as said:
        again.acquire()
    again.release()
    assert said == []  # a cleanly released lock is no takeover
