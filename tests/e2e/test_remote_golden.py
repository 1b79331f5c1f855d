"""Golden test of the remote tier: the machine is lost, the run continues from the store.

``examples/char_lm.py --remote s3://...`` is killed -9 twice -- once while a checkpoint's data
is being uploaded (the proxy holds that request, so the kill lands mid-upload for certain),
once at a step drawn from a seed -- and after each kill its run directory is deleted, as if the
node were gone. Relaunched with an empty directory, it resumes from the newest complete remote
checkpoint and ends bitwise equal to an uninterrupted run: every tensor, all JSON state and the
whole per-step metrics log. An upload killed before its manifest never counts as a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import ROOT, assert_identical, launch
from unbroken.store.remote._bucket import RemoteStore

CHAR_LM = ROOT / "examples" / "char_lm.py"
ARGS = ["--steps", "12", "--save-every", "3", "--workers", "0", "--context", "32"]


def start(run_dir: Path, url: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(CHAR_LM), *ARGS, "--run-dir", str(run_dir), "--remote", url]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_bytes().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(x).get("step", 0) for x in lines if x.strip().endswith(b"}")]
    return max(steps, default=0)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [7])
def test_char_lm_survives_the_loss_of_its_machine(s3, tmp_path, seed):
    rng = random.Random(seed)
    ref = tmp_path / "ref"
    assert launch(CHAR_LM, [*ARGS, "--run-dir", str(ref)]) == 0
    run = tmp_path / "run"
    store = RemoteStore(s3.url)

    # 1. Killed while the data of the second checkpoint it uploads is in flight. Which step
    # that is, is the uploader's: it uploads the newest checkpoint whenever it is free, and
    # char_lm's steps here (~15 ms) outrun an upload with its remote retention (~0.1 s), so 6
    # and 9 may both be skipped; the first one (step 3) is always uploaded, whole.
    s3.proxy.hold(r"^PUT .*step-0000000(0[4-9]|1[0-2])/tensors-r00000\.bin")
    proc = start(run, s3.url)
    deadline = time.monotonic() + 120
    while not s3.proxy.held.wait(0.05):
        assert proc.poll() is None, (s3.proxy.requests("^PUT"), proc.stderr.read().decode())
        assert time.monotonic() < deadline, "the upload never started"
    k = int(re.search(r"step-(\d+)/", s3.proxy.held_line).group(1))
    kill(proc)
    s3.proxy.drop()
    partial = store.scan()[k]
    assert partial and "manifest.json" not in partial  # objects of step k are there ...
    listed = [item.step for item in store.listing(checksums=True)]
    assert k not in listed and all(s < k for s in listed)  # ... but no checkpoint
    assert listed == [3], listed  # the first upload committed before the second began
    assert all(item.valid for item in store.listing(checksums=True))
    shutil.rmtree(run)

    # 2. Killed at a drawn step, after it resumed from the store. The final checkpoint's
    # upload is held meanwhile: the run exits 0 only once the store has it, so the kill finds
    # it alive however late it comes (then mid-way through that upload).
    j = rng.randint(4, 11)  # it resumes from step 3
    s3.proxy.hold(rf"^PUT .*step-{12:09d}/tensors-r00000\.bin")
    proc = start(run, s3.url)
    deadline = time.monotonic() + 120
    while logged_step(run) < j:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)
    kill(proc)
    s3.proxy.drop()  # a held upload (if the kill came that late) never arrives
    s3.proxy.hold("(?!)")  # and none is held from now on
    shutil.rmtree(run)

    # 3. Relaunched on an empty directory: to the end, from the store.
    code = launch(CHAR_LM, [*ARGS, "--run-dir", str(run), "--remote", s3.url])
    assert code == 0
    assert_identical(ref, run)
    latest = store.latest(checksums=True)
    assert latest is not None and latest.step == 12  # the final checkpoint is durable
    assert all(item.valid for item in store.listing(checksums=True))
