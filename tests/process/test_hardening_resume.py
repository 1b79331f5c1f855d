"""Never start over on top of real checkpoints; never lose one that could not be loaded.

A run directory whose checkpoints none of which loads is an error naming each, not a fresh
start (which retention would follow by deleting them); ``start_over=True`` moves them aside.
A newest checkpoint that cannot be loaded is moved aside, so that re-saving its step or
retention never destroys it. ``ls``/``latest()`` racing a live run's retention see a deleted
checkpoint as gone.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import unbroken
from tests._logs import logged
from tests._store_helpers import ckpt, make_run
from tests.golden import ROOT, assert_identical, launch
from unbroken import CorruptCheckpointError
from unbroken.store import CheckpointStore, _store

TOY = ROOT / "tests" / "scripts" / "toy_train.py"
ARGS = ["--steps", "20", "--save-every", "5"]


def files_of(path: str) -> dict[str, bytes]:
    """Every file under ``path`` (relative name -> bytes)."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def biggest_file(directory: str) -> str:
    names = os.listdir(directory)
    return os.path.join(
        directory, max(names, key=lambda n: os.path.getsize(os.path.join(directory, n)))
    )


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        raw[len(raw) // 2] ^= 0xFF
        f.seek(0)
        f.write(raw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("ref") / "run"
    assert launch(TOY, [*ARGS, "--run-dir", str(ref)]) == 0
    return ref


def _killed_at(run: Path, step: int) -> None:
    assert launch(TOY, [*ARGS, "--run-dir", str(run), "--signal-at", str(step)]) == -9


def test_unusable_newest_is_set_aside_and_the_run_resumes_exactly(reference, tmp_path):
    """kill -9 after step 17 (checkpoints 5, 10, 15); step 15's manifest is cut short. The
    relaunch resumes from 10, bit for bit, and the unreadable step 15 survives the re-save of
    step 15, the saves after it and retention, byte for byte, outside the checkpoint names."""
    run = tmp_path / "run"
    _killed_at(run, 17)
    bad = ckpt(str(run), 15)
    truncate(os.path.join(bad, "manifest.json"))
    before = files_of(bad)
    assert launch(TOY, [*ARGS, "--run-dir", str(run)]) == 0
    assert_identical(reference, run)
    aside = glob.glob(os.path.join(run, "checkpoints", "unusable-step-000000015-*"))
    assert len(aside) == 1, os.listdir(run / "checkpoints")
    assert files_of(aside[0]) == before
    steps = [s for s, _ in unbroken.store.scan(str(run))]
    assert steps == [20, 15, 10], steps  # retention ran (keep_last=3) and left the aside alone


def test_checkpoints_none_of_which_loads_are_an_error_not_a_fresh_start(tmp_path):
    run = tmp_path / "run"
    _killed_at(run, 12)  # checkpoints 5 and 10, a log of 12 steps
    truncate(os.path.join(ckpt(str(run), 10), "manifest.json"))
    flip(biggest_file(ckpt(str(run), 5)))  # the tensor data: a checksum mismatch
    before = files_of(str(run))
    proc = subprocess.run(
        [sys.executable, str(TOY), *ARGS, "--run-dir", str(run)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    err = proc.stderr
    assert "CorruptCheckpointError: none of the 2 checkpoint(s)" in err, err[-3000:]
    assert f"{ckpt(str(run), 10)}: " in err and f"{ckpt(str(run), 5)}: " in err, err[-3000:]
    assert "start_over=True" in err
    # Nothing was written, truncated or deleted: not the checkpoints, not the metrics log.
    after = files_of(str(run))
    after.pop(".unbroken.lock")
    before.pop(".unbroken.lock")
    assert after == before

    # Starting over is explicit: start_over=True moves everything aside, deleting nothing.
    model = torch.nn.Linear(2, 1)
    with logged() as said:
        r = unbroken.Run(run, model=model, start_over=True, max_steps=3, progress=False)
    assert any("start_over: moved 2 checkpoint" in m for m in said), said
    for _ in r.loop(range(10)):
        r.step(loss=0.0)
    assert [s for s, _ in unbroken.store.scan(str(run))] == [3]
    (abandoned,) = glob.glob(os.path.join(run, "checkpoints", "abandoned-*"))
    kept = files_of(abandoned)
    for name, data in before.items():
        if name.startswith(os.path.join("oracle", "")):
            continue  # the script's own record (tests/scripts/_oracle.py): not unbroken's to move
        moved = name.replace(os.path.join("checkpoints", ""), "", 1)
        assert kept[moved] == data, name
    assert [m["step"] for m in unbroken.read_metrics(run)] == [1, 2, 3]


def test_run_refuses_in_process_and_releases_the_lock(tmp_path):
    make_run(str(tmp_path), (1, 2))
    for s in (1, 2):
        truncate(os.path.join(ckpt(str(tmp_path), s), "manifest.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # the failed start released the lock: the second fails the same way
            with pytest.raises(CorruptCheckpointError, match="none of the 2 checkpoint"):
                unbroken.Run(tmp_path, model=torch.nn.Linear(2, 1), progress=False)
    with pytest.raises(unbroken.ConfigError, match="start_over"):
        unbroken.Run(tmp_path, model=torch.nn.Linear(2, 1), resume=False, progress=False)
    with pytest.raises(unbroken.ConfigError, match="start_over=True starts fresh"):
        unbroken.Run(tmp_path, model=torch.nn.Linear(2, 1), start_over=True, resume=3)


def test_a_checkpoint_deleted_while_it_is_read_is_gone_not_corrupt(tmp_path, monkeypatch):
    """``ls``/``inspect`` against a live run: retention deletes step 3 (rename to .del-, then
    rmtree, as it does) just as the reader opens it."""
    run = str(tmp_path)
    make_run(run, (1, 2, 3))
    real = _store.CheckpointReader

    class RacingRetention(real):  # type: ignore[misc, valid-type]
        def __init__(self, path: str) -> None:
            if path == ckpt(run, 3) and os.path.exists(path):
                doomed = os.path.join(os.path.dirname(path), ".del-step-000000003")
                os.rename(path, doomed)
                shutil.rmtree(doomed)
            super().__init__(path)

    monkeypatch.setattr(_store, "CheckpointReader", RacingRetention)
    store = CheckpointStore(run)
    with warnings.catch_warnings(), logged() as said:
        warnings.simplefilter("error")
        listed = store.listing()
        assert [(e.step, e.valid) for e in listed] == [(2, True), (1, True)]
        make_run(str(tmp_path / "again"), (1, 2, 3))
        run = str(tmp_path / "again")
        reader = CheckpointStore(run).latest()
    assert said == []  # gone is not "unusable"
    assert reader is not None and reader.step == 2
