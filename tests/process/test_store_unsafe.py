"""Crafted format-2 checkpoints: refused before anything is allocated or read, naming the file.

Each case crafts step 2 of a run whose step 1 is good, with every checksum fixed up (the
manifest's, and a chunk's where its bytes change), so that only validation can stop it.
Whatever the outcome (``latest()`` falls back to step 1 with a warning naming the file, or the
restore of step 2 raises), the error must be UnsafeCheckpointError or CorruptCheckpointError,
no payload may run, and ``unbroken inspect`` must refuse it as well.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import torch
import xxhash

import tests._store_helpers as h
from tests._store_helpers import (
    assert_same,
    ckpt,
    deadline,
    evil_pickle,
    fifo_for,
    latest,
    make_run,
    read_manifest_raw,
    refresh_manifest,
    restore,
    symlink_for,
    write_manifest_raw,
)
from unbroken import CorruptCheckpointError, Run
from unbroken.cli import main
from unbroken.errors import UnsafeCheckpointError
from unbroken.store import CheckpointReader, CheckpointStore

REFUSED = (UnsafeCheckpointError, CorruptCheckpointError)
TARGET = "model/0.weight"
DATA = "tensors-r00000.bin"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("base") / "run")
    return run, make_run(run, (1, 2))


@pytest.fixture
def case(base, tmp_path):
    src, snaps = base
    run = str(tmp_path / "run")
    shutil.copytree(src, run)
    return run, snaps, str(tmp_path / "MARKER")


def edit_table(edit: Callable[[dict[str, Any]], None]) -> Callable[[str], None]:
    def craft(d: str) -> None:
        path = os.path.join(d, "tensors.json")
        with open(path) as f:
            doc = json.load(f)
        edit(doc)
        with open(path, "w") as f:
            json.dump(doc, f)
        refresh_manifest(d, "tensors.json")

    return craft


def chunk(doc: dict[str, Any], fqn: str = TARGET) -> dict[str, Any]:
    return doc["tensors"][fqn]["chunks"][0]


def replace_file(name: str, data: bytes) -> Callable[[str], None]:
    def craft(d: str) -> None:
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
        if name != "manifest.json":
            refresh_manifest(d, name)

    return craft


def overlap(doc: dict[str, Any]) -> None:
    a, b = chunk(doc, "model/0.weight"), chunk(doc, "model/0.bias")
    b["offset"] = a["offset"] + 64


def manifest_edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[str], None]:
    def craft(d: str) -> None:
        m = read_manifest_raw(d)
        edit(m)
        write_manifest_raw(d, m)

    return craft


def manifest_text(d: str, number: str) -> None:
    """A number that JSON parses to infinity, in an otherwise consistent manifest."""
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        text = f.read()
    text, n = re.subn(r'"saved_at_unix":[0-9.e+]+', f'"saved_at_unix":{number}', text)
    assert n == 1
    with open(path, "w") as f:
        f.write(text)


def raw_json(name: str, text: str) -> Callable[[str], None]:
    return replace_file(name, text.encode())


def state_value(value: Any) -> Callable[[str], None]:
    """state.json's counters component replaced by ``value`` (a hostile state node)."""

    def craft(d: str) -> None:
        path = os.path.join(d, "state.json")
        with open(path) as f:
            doc = json.load(f)
        doc["components"]["counters"] = value
        with open(path, "w") as f:
            json.dump(doc, f)
        refresh_manifest(d, "state.json")

    return craft


def _set(**kw: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        chunk(doc).update(kw)

    return edit


def _tensor(**kw: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"][TARGET].update(kw)

    return edit


# case -> (craft(checkpoint dir), a word the error must name)
CASES: dict[str, tuple[Callable[[str], None], str]] = {
    "offset-past-end": (edit_table(_set(offset=10**12)), "lies at bytes"),
    "nbytes-past-end": (
        edit_table(lambda d: (_tensor(shape=[8, 400])(d), _set(sizes=[8, 400], nbytes=12800)(d))),
        "lies at bytes",
    ),
    "overlapping-tensors": (edit_table(overlap), "overlap"),
    "size-overflows": (edit_table(_tensor(shape=[2**40, 2**40])), "larger than any tensor"),
    "shape-10^15": (
        edit_table(lambda d: (_tensor(shape=[10**15])(d), _set(sizes=[10**15], offsets=[0])(d))),
        "holds 128 bytes",
    ),
    "unknown-dtype": (edit_table(_tensor(dtype="object")), "not a known one"),
    "dtype-not-a-string": (edit_table(_tensor(dtype=["float32"])), "not a known one"),
    "nbytes-disagrees": (edit_table(_set(nbytes=4)), "holds 4 bytes"),
    "chunk-outside-tensor": (edit_table(_set(offsets=[5, 0])), "outside shape"),
    "chunks-do-not-cover": (edit_table(_set(sizes=[4, 4], nbytes=64)), "cover"),
    "negative-offset": (edit_table(_set(offset=-64)), "chunk offset"),
    "bool-offset": (edit_table(_set(offset=True)), "chunk offset"),
    "file-escape": (edit_table(_set(file="../x.bin")), "../x.bin"),
    "absolute-file": (edit_table(_set(file="/etc/passwd")), "/etc/passwd"),
    "file-not-in-manifest": (edit_table(_set(file="other.bin")), "other.bin"),
    "bad-checksum-field": (edit_table(_set(xxh3_64="zz")), "checksum is malformed"),
    "table-pickle": (lambda d: replace_file("tensors.json", evil_pickle("M"))(d), "tensors.json"),
    "table-deep": (raw_json("tensors.json", "[" * 200_000 + "]" * 200_000), "tensors.json"),
    "table-inf": (raw_json("tensors.json", '{"format": 1e999}'), "tensors.json"),
    "manifest-1e999": (lambda d: manifest_text(d, "1e999"), "overflows"),
    "manifest-world-10^9": (manifest_edit(lambda m: m.update(world_size=10**9)), "world size"),
    "manifest-deep": (raw_json("manifest.json", "[" * 200_000 + "]" * 200_000), "manifest"),
    "state-pickle": (replace_file("state.json", evil_pickle("M")), "state.json"),
    "rank-pickle": (replace_file("rank-00000.json", evil_pickle("M")), "rank-00000.json"),
    "state-bad-bytes": (state_value({"$bytes": "!!!"}), "state.json"),
    "state-bad-device": (state_value({"$device": "nope:7"}), "state.json"),
    "state-bad-size": (state_value({"$size": ["x"]}), "state.json"),
    "state-bad-dict": (state_value({"$dict": [[{"a": 1}, 2]]}), "state.json"),
    "state-bad-ndarray": (state_value({"$ndarray": {"dtype": "O", "shape": [1], "data": ""}}), ""),
    "state-tensor-list": (state_value({"$tensor": ["a"]}), "state.json"),
    "fifo-data-file": (fifo_for(DATA), DATA),
    "fifo-table": (fifo_for("tensors.json"), "tensors.json"),
    "symlink-data-file": (symlink_for(DATA), DATA),
    "symlink-table": (symlink_for("tensors.json"), "tensors.json"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_crafted_checkpoint_is_refused(case, name, capsys):
    run, snaps, _ = case
    craft, named = CASES[name]
    d = ckpt(run, 2)
    craft(d)
    with deadline(20):
        # 1. the start-up path: latest() and a full restore
        reader, warned = latest(CheckpointStore(run))
        assert reader is not None
        if reader.step == 2:
            with pytest.raises(REFUSED) as ei:
                restore(reader)
            msg = str(ei.value)
        else:
            assert reader.step == 1 and len(warned) == 1, warned
            msg = warned[0]
            assert d in msg
            assert_same(restore(reader), snaps[1])
        assert named in msg, msg
        # 2. opening the crafted checkpoint directly
        with pytest.raises(REFUSED):
            r = CheckpointReader(d)
            r.verify()
            r.check_contents()
            restore(r)
        # 3. unbroken inspect refuses it too (it runs the checks a load runs)
        code = main(["inspect", d])
        err = capsys.readouterr().err
        assert code == 1 and "unbroken:" in err and named in err, (code, err)


def test_a_chunk_whose_bytes_changed_is_refused_by_the_load_itself(case):
    """Checksums of whole files fixed up: the per-chunk checksum still catches the change,
    during the load, naming the tensor -- even when the pre-load checksum pass is skipped."""
    run, _, _ = case
    d = ckpt(run, 2)
    with open(os.path.join(d, "tensors.json")) as f:
        c = chunk(json.load(f))
    with open(os.path.join(d, DATA), "r+b") as f:
        f.seek(c["offset"])
        b = f.read(1)
        f.seek(c["offset"])
        f.write(bytes([b[0] ^ 1]))
    r = CheckpointReader(d)
    r.verify(checksums=False)
    with pytest.raises(CorruptCheckpointError, match=re.escape(TARGET)):
        restore(r)


def test_every_chunk_checksum_is_what_the_file_holds(base):
    run, _ = base
    d = ckpt(run, 2)
    with open(os.path.join(d, "tensors.json")) as f:
        doc = json.load(f)
    with open(os.path.join(d, DATA), "rb") as f:
        raw = f.read()
    for entry in doc["tensors"].values():
        for c in entry["chunks"]:
            got = xxhash.xxh3_64_hexdigest(raw[c["offset"] : c["offset"] + c["nbytes"]])
            assert got == c["xxh3_64"]
            assert c["offset"] % 64 == 0


def test_nothing_in_the_library_unpickles():
    """No pickle-reading code in the library: the only format (2) is JSON and raw bytes; the
    pickled format 1 of a pre-release is refused by name (test_a_format_1_checkpoint_is_refused)."""
    grep = subprocess.run(
        ["grep", "-rlnE", r"import pickle|pickle\.|_get_layout|_StorageInfo", "unbroken/"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    users = sorted(p for p in grep.stdout.split() if p.endswith(".py"))
    assert users == [], users


def test_a_format_1_checkpoint_is_refused_by_name(tmp_path) -> None:
    """Format 1 existed before any release; a directory of it is refused with what to do, and
    left where it is (nothing the user saved is lost)."""
    run = str(tmp_path / "run")
    h.make_run(run, (1,))
    step = os.path.join(run, "checkpoints", os.listdir(os.path.join(run, "checkpoints"))[0])
    m = h.read_manifest_raw(step)
    m["format_version"] = 1
    h.write_manifest_raw(step, m)
    with pytest.raises(CorruptCheckpointError, match="format 1") as e:
        CheckpointReader(step)
    assert "start_over=True" in str(e.value) and "unbroken export" in str(e.value)
    with pytest.raises(CorruptCheckpointError, match="format 1"):
        Run(run, model=torch.nn.Linear(2, 1))
    assert os.path.isdir(step)
