"""A damaged newest checkpoint is detected, named in the warning, and the previous one is used."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests._logs import logged
from tests._store_helpers import (
    assert_same,
    ckpt,
    evil_pickle,
    latest,
    make_run,
    read_manifest_raw,
    restore,
    write_manifest_raw,
)
from unbroken import CorruptCheckpointError
from unbroken.store import CheckpointReader, CheckpointStore

FILES = ["tensors.json", "tensors-r00000.bin", "state.json", "rank-00000.json", "manifest.json"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("base") / "run")
    return run, make_run(run, (1, 2))


@pytest.fixture
def run(base, tmp_path):
    """A fresh copy of a run with good checkpoints at steps 1 and 2."""
    src, snaps = base
    dst = str(tmp_path / "run")
    shutil.copytree(src, dst)
    return dst, snaps


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        raw[len(raw) // 2] ^= 0x01
        f.seek(0)
        f.write(raw)


def expect_fallback(run: str, snaps, *named: str, bad: int = 2) -> str:
    """latest() warns once, naming checkpoint ``bad`` and ``named``; step 1 loads as saved."""
    reader, warned = latest(CheckpointStore(run))
    assert reader is not None and reader.step == 1, warned
    assert len(warned) == 1, warned
    assert ckpt(run, bad) in warned[0]
    for name in named:
        assert name in warned[0], warned[0]
    assert_same(restore(reader), snaps[1])
    return warned[0]


@pytest.mark.parametrize("name", FILES)
def test_truncated_file(run, name):
    run, snaps = run
    truncate(os.path.join(ckpt(run, 2), name))
    expect_fallback(run, snaps, os.path.join(ckpt(run, 2), name))


@pytest.mark.parametrize("name", FILES)
def test_flipped_byte(run, name):
    run, snaps = run
    flip(os.path.join(ckpt(run, 2), name))
    msg = expect_fallback(run, snaps, os.path.join(ckpt(run, 2), name))
    assert "checksum" in msg or "not valid JSON" in msg


@pytest.mark.parametrize("name", FILES)
def test_deleted_file(run, name):
    run, snaps = run
    os.remove(os.path.join(ckpt(run, 2), name))
    msg = expect_fallback(run, snaps, os.path.join(ckpt(run, 2), name))
    assert "missing" in msg


def test_flipped_step_in_manifest_is_caught_by_its_own_checksum(run):
    run, snaps = run
    path = os.path.join(ckpt(run, 2), "manifest.json")
    with open(path, "rb") as f:
        raw = f.read()
    assert raw.count(b'"step":2') == 1
    with open(path, "wb") as f:
        f.write(raw.replace(b'"step":2', b'"step":3'))  # one bit: 0x32 -> 0x33
    msg = expect_fallback(run, snaps, path)
    assert "own checksum" in msg


def test_renamed_checkpoint_dir_is_not_trusted(run):
    run, snaps = run
    os.rename(ckpt(run, 2), ckpt(run, 7))
    expect_fallback(run, snaps, "manifest of step 2", bad=7)


def test_manifest_with_wrong_file_checksum(run):
    run, snaps = run
    m = read_manifest_raw(ckpt(run, 2))
    rec = m["files"]["tensors-r00000.bin"]
    rec["xxh3_64"] = format(int(rec["xxh3_64"], 16) ^ 1, "016x")
    write_manifest_raw(ckpt(run, 2), m)  # a consistent manifest that lies about one file
    msg = expect_fallback(run, snaps, os.path.join(ckpt(run, 2), "tensors-r00000.bin"))
    assert "checksum" in msg


def test_manifest_with_wrong_file_size(run):
    run, snaps = run
    m = read_manifest_raw(ckpt(run, 2))
    m["files"]["state.json"]["size"] += 1
    write_manifest_raw(ckpt(run, 2), m)
    expect_fallback(run, snaps, os.path.join(ckpt(run, 2), "state.json"), "bytes")


def test_manifest_not_listing_the_metadata(run):
    run, snaps = run
    m = read_manifest_raw(ckpt(run, 2))
    del m["files"]["tensors.json"]
    write_manifest_raw(ckpt(run, 2), m)
    expect_fallback(run, snaps, "tensors.json")


def test_manifest_that_is_not_ours(run):
    run, snaps = run
    with open(os.path.join(ckpt(run, 2), "manifest.json"), "w") as f:
        json.dump({"format": "something-else", "step": 2}, f)
    expect_fallback(run, snaps, "manifest.json", "not an unbroken manifest")


def test_extra_unknown_files_are_ignored_and_never_loaded(run, tmp_path):
    run, snaps = run
    marker = str(tmp_path / "MARKER")
    d = ckpt(run, 2)
    for name in ("tensors-r00001.bin", "extra.pt", "notes.txt"):
        with open(os.path.join(d, name), "wb") as f:
            f.write(evil_pickle(marker))
    os.mkdir(os.path.join(d, "subdir"))
    reader, warned = latest(CheckpointStore(run))
    assert warned == []
    assert reader is not None and reader.step == 2
    assert_same(restore(reader), snaps[2])
    assert not os.path.exists(marker)


def test_every_checkpoint_corrupt_is_an_error_naming_each(run):
    # Not "no checkpoint": a run must not start over on top of checkpoints it cannot read.
    run, _ = run
    flip(os.path.join(ckpt(run, 1), "tensors-r00000.bin"))
    truncate(os.path.join(ckpt(run, 2), "state.json"))
    with logged() as warned, pytest.raises(CorruptCheckpointError) as ei:
        CheckpointStore(run).latest()
    assert len(warned) == 2
    assert ckpt(run, 2) in warned[0] and ckpt(run, 1) in warned[1]
    msg = str(ei.value)
    assert "none of the 2 checkpoint(s)" in msg and "start_over" in msg, msg
    assert ckpt(run, 2) + ": " in msg and "state.json" in msg, msg
    assert ckpt(run, 1) + ": " in msg and "checksum" in msg, msg


def test_without_checksums_sizes_are_still_checked(run):
    run, _ = run
    truncate(os.path.join(ckpt(run, 2), "tensors-r00000.bin"))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        CheckpointReader(ckpt(run, 2)).verify(checksums=False)
