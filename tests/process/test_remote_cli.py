"""Remote checkpoints meet the same refusals as local ones, and the CLI reads s3:// URLs.

Every crafted format-2 checkpoint of tests/process/test_store_unsafe.py (but the FIFO and symlink
cases: an object store has neither) is uploaded as it is -- bypassing unbroken's uploader, its
manifest last -- beside a good older one. Opening it from the store must refuse it with the
same error, naming the object, with no payload run; ``latest()`` must fall back past it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests._logs import logged
from tests._store_helpers import assert_same, ckpt, make_run, restore
from tests.process.test_remote import train
from tests.process.test_store_unsafe import CASES, REFUSED
from unbroken.cli import main
from unbroken.store import CheckpointStore
from unbroken.store.remote._bucket import RemoteStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REMOTE_CASES = [n for n in CASES if not n.startswith(("fifo-", "symlink-"))]


def put_raw(store: RemoteStore, local: str, step: int) -> None:
    """Upload a checkpoint directory object by object, the manifest last, unchecked (what
    was there for ``step`` before is deleted first)."""
    folder = f"checkpoints/step-{step:09d}"
    store.objects.delete(f"{folder}/{n}" for n in store.scan().get(step, {}))
    names = sorted(n for n in os.listdir(local) if n != "manifest.json") + ["manifest.json"]
    for name in names:
        with open(os.path.join(local, name), "rb") as f:
            store.objects.put_bytes(f"{folder}/{name}", f.read())


def test_crafted_remote_checkpoints_are_refused(s3, tmp_path, capsys):
    base = str(tmp_path / "base")
    snaps = make_run(base, (1, 2))
    marker = str(tmp_path / "MARKER")
    store = RemoteStore(s3.url)
    put_raw(store, ckpt(base, 1), 1)
    for i, name in enumerate(REMOTE_CASES):
        craft, named = CASES[name]
        work = str(tmp_path / f"case-{i}")
        shutil.copytree(ckpt(base, 2), work)
        craft(work)
        put_raw(store, work, 2)
        with logged() as warned:  # 1. the start-up path: latest(), then a restore
            reader = store.latest(checksums=False)
        assert reader is not None, name
        if reader.step == 2:
            with pytest.raises(REFUSED) as ei:
                restore(reader)
            msg = str(ei.value)
        else:
            assert reader.step == 1 and len(warned) == 1, (name, warned)
            msg = warned[0]
            assert_same(restore(reader), snaps[1])
        assert named in msg, (name, msg)
        assert "step-000000002" in msg, (name, msg)
        with pytest.raises(REFUSED):  # 2. that checkpoint opened directly, every check
            r = store.open(2, checksums=True)
            r.check_contents()
            restore(r)
        code = main(["inspect", f"{s3.url}/checkpoints/step-000000002"])  # 3. the CLI
        err = capsys.readouterr().err
        assert code == 1 and named in err, (name, code, err)
    assert not os.path.exists(marker)


def test_the_cli_reads_remote_urls(s3, tmp_path, capsys):
    run, model = train(tmp_path / "run", s3.url, steps=4, save_every=2)
    capsys.readouterr()
    assert main(["ls", s3.url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["valid"], r["latest"]) for r in rows] == [
        (4, True, True),
        (2, True, False),
    ]
    assert all(r["size_bytes"] > 0 for r in rows)
    assert main(["inspect", s3.url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 4 and info["path"] == f"{s3.url}/checkpoints/step-000000004"
    assert main(["inspect", s3.url, "--step", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    out = str(tmp_path / "w.safetensors")
    assert main(["export", s3.url, "--to", "safetensors", "--out", out]) == 0
    from safetensors.torch import load_file

    assert torch.equal(load_file(out)["weight"], model.weight.detach())
    local = str(tmp_path / "run" / "checkpoints" / "step-000000004")
    assert main(["diff", s3.url, local]) == 0  # the store holds the very same state
    assert main(["diff", f"{s3.url}/checkpoints/step-000000002", local]) == 1
    capsys.readouterr()
    assert main(["ls", f"s3://{s3.bucket}/nothing-here"]) == 3
    assert main(["inspect", f"s3://{s3.bucket}/nothing-here"]) == 3
    # The same steps, the same bytes: local and remote listings agree.
    assert [i.step for i in CheckpointStore(str(tmp_path / "run")).listing()] == [4, 2]


def test_ls_of_a_store_shows_when_each_was_saved_and_what_a_corrupt_one_holds(s3, tmp_path, capsys):
    """``unbroken ls s3://...`` as of a run directory: the commit time the manifest records
    (it was null for every remote row), and the size of what a corrupt checkpoint holds in the
    store (it was 0 B)."""
    before = time.time()
    train(tmp_path / "run", s3.url, steps=4, save_every=2)
    local = ckpt(str(tmp_path / "run"), 4)
    bad = str(tmp_path / "bad")
    shutil.copytree(local, bad)
    with open(os.path.join(bad, "tensors-r00000.bin"), "r+b") as f:
        f.seek(70)
        byte = f.read(1)
        f.seek(70)
        f.write(bytes([byte[0] ^ 1]))
    put_raw(RemoteStore(s3.url), bad, 4)
    capsys.readouterr()
    assert main(["ls", s3.url, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert not rows[4]["valid"] and rows[2]["valid"] and rows[2]["latest"]
    stored = sum(os.path.getsize(os.path.join(bad, n)) for n in os.listdir(bad))
    assert rows[4]["size_bytes"] == stored, rows[4]
    for r in rows.values():
        assert isinstance(r["saved_at_unix"], float), r
        assert before - 1 <= r["saved_at_unix"] <= time.time(), r
    assert main(["ls", s3.url]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[0] == "4" and " 0 B " not in table[1], table


def test_unbroken_imports_and_runs_without_boto3(tmp_path):
    """boto3 is an extra: without it everything but remote= works, and remote= says what
    to install."""
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("boto3", "botocore", "s3transfer"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import torch, unbroken
m = torch.nn.Linear(2, 2)
run = unbroken.Run({str(tmp_path / "a")!r}, model=m, max_steps=1, handle_signals=False)
run.step(); run.finish()
try:
    unbroken.Run({str(tmp_path / "b")!r}, model=m, remote="s3://some-bucket/x",
                 handle_signals=False)
except unbroken.ConfigError as e:
    print("ERROR", e)
assert not any(k.startswith("boto") for k in sys.modules)
"""
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "pip install 'unbroken[s3]'" in p.stdout
