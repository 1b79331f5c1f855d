"""Crafted format-1 checkpoints: loading never runs code, never leaves the directory, never
over-allocates. Format 1 (unbroken 0.1: DCP's pickled metadata and torch.save records) is only
read now, for old run directories, so the run under attack is a copy of the format-1 fixture
written by the old writer (tests/data/v1-run); test_store_unsafe.py attacks format 2.

Each case crafts step 2 of a run whose step 1 is good, with the manifest's sizes and checksums
fixed up so that only the safety checks can stop it. Whatever the outcome (``latest()`` falls
back to step 1 with a warning naming the file, or the restore of step 2 raises), MARKER must
never appear and the error must be UnsafeCheckpointError or CorruptCheckpointError.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from tests._store_helpers import (
    Evil,
    assert_same,
    ckpt,
    deadline,
    evil_pickle,
    fifo_for,
    latest,
    refresh_manifest,
    restore,
    rewrite_metadata,
    symlink_for,
)
from unbroken import CorruptCheckpointError, UnsafeCheckpointError
from unbroken.cli import main
from unbroken.store import CheckpointReader, CheckpointStore
from unbroken.store._v1 import MAX_METADATA_BYTES, read_metadata

REFUSED = (UnsafeCheckpointError, CorruptCheckpointError)
TARGET = "model/0.weight"


V1_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "v1-run")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # What the pristine fixture restores to (test_format_compat checks that against what the
    # old writer saved) is what a fallback to its step 1 must give.
    snaps = {s: restore(CheckpointStore(V1_RUN).open(s)) for s in (1, 2)}
    return V1_RUN, snaps


@pytest.fixture
def case(base, tmp_path):
    src, snaps = base
    run = str(tmp_path / "run")
    shutil.copytree(src, run)
    return run, snaps, str(tmp_path / "MARKER")


# ---- crafting ---------------------------------------------------------------------------------


def replace_file(d: str, name: str, data: bytes) -> None:
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    if name != "manifest.json":
        refresh_manifest(d, name)


def replace_record(d: str, fqn: str, make: Callable[[bytes], bytes]) -> None:
    """Replace tensor ``fqn``'s record in the DCP data file by ``make(old record)``; shift the
    other records, rewrite the metadata to match and fix up the manifest."""
    md = read_metadata(d)
    items = sorted(md.storage_data.items(), key=lambda kv: kv[1].offset)
    name = items[0][1].relative_path
    with open(os.path.join(d, name), "rb") as f:
        raw = f.read()
    out, infos = bytearray(), {}
    for idx, info in items:
        rec = raw[info.offset : info.offset + info.length]
        if idx.fqn == fqn:
            rec = make(rec)
        infos[idx] = _StorageInfo(name, len(out), len(rec), None)
        out += rec
    with open(os.path.join(d, name), "wb") as f:
        f.write(out)

    def edit(m: dcp_md.Metadata) -> None:
        m.storage_data = infos

    rewrite_metadata(d, edit, md)
    refresh_manifest(d, name)


def zip_with_pickle(payload: bytes) -> Callable[[bytes], bytes]:
    """A torch.save zip record whose data.pkl is ``payload`` (storages left as they were)."""

    def make(rec: bytes) -> bytes:
        src = zipfile.ZipFile(io.BytesIO(rec))
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                data = payload if info.filename.endswith("/data.pkl") else src.read(info)
                dst.writestr(info.filename, data)
        return buf.getvalue()

    return make


def set_path(path_for: Callable[[str], str]) -> Callable[[str], None]:
    """Point every storage entry at ``path_for(checkpoint dir)`` (a valid copy lies there)."""

    def craft(d: str) -> None:
        target = path_for(d)
        if not target.startswith(d):
            shutil.copy(os.path.join(d, "__0_0.distcp"), os.path.normpath(target))

        def edit(md: dcp_md.Metadata) -> None:
            md.storage_data = {
                k: _StorageInfo(target, v.offset, v.length, None)
                for k, v in md.storage_data.items()
            }

        rewrite_metadata(d, edit)

    return craft


def huge_shape(d: str) -> None:
    def edit(md: dcp_md.Metadata) -> None:
        tmd = md.state_dict_metadata[TARGET]
        tmd.size = torch.Size([10**15])
        tmd.chunks = [dcp_md.ChunkStorageMetadata(torch.Size([0]), torch.Size([10**15]))]

    rewrite_metadata(d, edit)


def metadata_with_evil_field(marker: str) -> Callable[[str], None]:
    """Genuine DCP metadata with one field holding the payload (a subtler .metadata)."""

    def craft(d: str) -> None:
        def edit(md: dcp_md.Metadata) -> None:
            md.planner_data = Evil(marker)

        rewrite_metadata(d, edit)

    return craft


# case -> (craft(checkpoint dir, marker), what the error names)
CASES: dict[str, tuple[Callable[[str, str], None], str]] = {
    "metadata-pickle": (
        lambda d, m: replace_file(d, ".metadata", evil_pickle(m)),
        ".metadata: DCP metadata refers to posix.system",
    ),
    "metadata-field": (
        lambda d, m: metadata_with_evil_field(m)(d),
        ".metadata: DCP metadata refers to posix.system",
    ),
    "distcp-record-pickle": (
        lambda d, m: replace_record(d, TARGET, lambda _: evil_pickle(m)),
        TARGET,
    ),
    "distcp-zip-data.pkl": (
        lambda d, m: replace_record(d, TARGET, zip_with_pickle(evil_pickle(m))),
        TARGET,
    ),
    "manifest-pickle": (
        lambda d, m: replace_file(d, "manifest.json", evil_pickle(m)),
        "manifest.json",
    ),
    "state-pickle": (
        lambda d, m: replace_file(d, "state.json", evil_pickle(m)),
        "state.json",
    ),
    "rank-pickle": (
        lambda d, m: replace_file(d, "rank-00000.json", evil_pickle(m)),
        "rank-00000.json",
    ),
    "relative-path-escape": (
        lambda d, m: set_path(lambda d: "../x")(d),
        "'../x'",
    ),
    "absolute-path": (
        lambda d, m: set_path(lambda d: os.path.join(os.path.dirname(d), "abs.distcp"))(d),
        "abs.distcp",
    ),
    "fifo-data-file": (lambda d, m: fifo_for("__0_0.distcp")(d), "__0_0.distcp"),
    "fifo-metadata": (lambda d, m: fifo_for(".metadata")(d), ".metadata"),
    "symlink-data-file": (lambda d, m: symlink_for("__0_0.distcp")(d), "__0_0.distcp"),
    "shape-10^15": (lambda d, m: huge_shape(d), "refusing to allocate"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_crafted_checkpoint_is_refused(case, name, capsys):
    run, snaps, marker = case
    craft, named = CASES[name]
    d = ckpt(run, 2)
    craft(d, marker)
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
            assert d in msg and any(w in msg for w in ("Unsafe", "unsafe", "not", "refus"))
            assert_same(restore(reader), snaps[1])
        assert named in msg, msg
        # 2. opening the crafted checkpoint directly
        with pytest.raises(REFUSED):
            r = CheckpointReader(d)
            r.verify()
            restore(r)
        # 3. unbroken inspect refuses it too, naming the same thing
        code = main(["inspect", d])
        err = capsys.readouterr().err
        assert code == 1 and "unbroken:" in err and named in err, (code, err)
    assert not os.path.exists(marker), "the payload ran"


def test_the_payload_is_live(tmp_path):
    """The crafted payloads do run code when unpickled plainly (so the tests above can fail)."""
    marker = str(tmp_path / "MARKER")
    pickle.loads(evil_pickle(marker))
    assert os.path.exists(marker)
    os.remove(marker)
    rec = zip_with_pickle(evil_pickle(marker))(_a_record())
    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(rec), weights_only=True)
    assert not os.path.exists(marker)
    torch.load(io.BytesIO(rec), weights_only=False)
    assert os.path.exists(marker)


def _a_record() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.arange(4.0), buf)
    return buf.getvalue()


def test_fifo_extra_file_is_ignored(case):
    run, snaps, _ = case
    os.mkfifo(os.path.join(ckpt(run, 2), "__1_0.distcp"))
    with deadline(20):
        reader, warned = latest(CheckpointStore(run))
        assert warned == [] and reader is not None and reader.step == 2
        assert_same(restore(reader), snaps[2])


def test_oversized_metadata_is_refused_before_reading(case):
    run, _, _ = case
    path = os.path.join(ckpt(run, 2), ".metadata")
    os.truncate(path, MAX_METADATA_BYTES + 1)  # sparse: nothing is really written
    with pytest.raises(CorruptCheckpointError, match="more than any metadata"):
        read_metadata(ckpt(run, 2))


def test_offsets_past_the_end_are_refused(case):
    run, _, _ = case
    d = ckpt(run, 2)

    def edit(md: dcp_md.Metadata) -> None:
        md.storage_data = {
            k: _StorageInfo(v.relative_path, v.offset + 10**12, v.length, None)
            for k, v in md.storage_data.items()
        }

    rewrite_metadata(d, edit)
    with pytest.raises(CorruptCheckpointError, match="lies at bytes"):
        CheckpointReader(d).tensor_infos()
