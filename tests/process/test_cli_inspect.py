"""``unbroken ls`` and ``unbroken inspect`` on real run directories."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests._store_helpers import REPO, ckpt, make_registry, make_run, save, train
from unbroken.cli import build_parser, main
from unbroken.store import CheckpointReader, CheckpointStore, TensorReader, _direct


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("base") / "run")
    make_run(run, (1, 2, 3))
    return run


@pytest.fixture
def run(base, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(base, dst)
    return dst


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        raw[len(raw) // 2] ^= 0x01
        f.seek(0)
        f.write(raw)


# ---- ls ---------------------------------------------------------------------------------------


def test_ls_table(run, capsys):
    CheckpointStore(run).pin(1)
    flip(os.path.join(ckpt(run, 3), "tensors-r00000.bin"))
    code, out, err = cli(capsys, "ls", run)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "SIZE", "AGE", "PINNED", "STATUS"]
    assert len(lines) == 4
    assert lines[1].split()[0] == "3" and "corrupt: tensors-r00000.bin does not match" in lines[1]
    assert lines[2].split()[0] == "2" and lines[2].endswith("valid, latest")
    assert lines[3].split()[0] == "1" and "pinned" in lines[3] and lines[3].endswith("valid")
    assert "KiB" in lines[2]


def test_ls_json(run, capsys):
    CheckpointStore(run).pin(2)
    os.remove(os.path.join(ckpt(run, 1), "state.json"))
    code, out, _ = cli(capsys, "ls", run, "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [3, 2, 1]
    by_step = {r["step"]: r for r in rows}
    assert by_step[3]["valid"] and by_step[3]["latest"] and not by_step[3]["pinned"]
    assert by_step[2]["valid"] and not by_step[2]["latest"] and by_step[2]["pinned"]
    assert not by_step[1]["valid"] and "state.json is missing" in by_step[1]["reason"]
    assert by_step[3]["path"] == ckpt(run, 3)
    assert by_step[3]["size_bytes"] == sum(
        os.path.getsize(os.path.join(ckpt(run, 3), n)) for n in os.listdir(ckpt(run, 3))
    )
    assert 0 <= by_step[3]["age_seconds"] < 600
    assert by_step[3]["checked"] == "checksums"


def test_ls_no_verify_checks_sizes_only(run, capsys):
    flip(os.path.join(ckpt(run, 3), "tensors-r00000.bin"))
    with open(os.path.join(ckpt(run, 2), "tensors-r00000.bin"), "ab") as f:
        f.write(b"x")
    code, out, _ = cli(capsys, "ls", run, "--json", "--no-verify")
    assert code == 0
    rows = {r["step"]: r for r in json.loads(out)}
    assert rows[3]["valid"] and rows[3]["checked"] == "sizes"  # a flipped byte is not seen
    assert not rows[2]["valid"] and "bytes" in rows[2]["reason"]


def test_ls_without_valid_checkpoints_exits_3(tmp_path, run, capsys):
    code, out, err = cli(capsys, "ls", str(tmp_path / "missing"))
    assert code == 3 and "not a directory" in err
    os.makedirs(tmp_path / "empty")
    code, out, err = cli(capsys, "ls", str(tmp_path / "empty"))
    assert code == 3 and "no checkpoints" in out and "no valid checkpoint" in err
    for s in (1, 2, 3):
        os.remove(os.path.join(ckpt(run, s), "manifest.json"))
    code, out, err = cli(capsys, "ls", run)
    assert code == 3 and out.count("corrupt: manifest.json is missing") == 3


def test_ls_mentions_leftovers(run, capsys):
    os.makedirs(os.path.join(run, "checkpoints", ".tmp-step-000000004"))
    code, out, _ = cli(capsys, "ls", run)
    assert code == 0 and "1 unfinished save(s)" in out


# ---- inspect ----------------------------------------------------------------------------------


class _Local:
    """A rank-local component with a tensor (per-rank state, e.g. a sampler's buffer)."""

    rank_local = True

    def __init__(self) -> None:
        self.buf = torch.arange(6, dtype=torch.int64).reshape(2, 3)

    def state_dict(self) -> dict[str, Any]:
        return {"buf": self.buf}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.buf = sd["buf"]


@pytest.fixture
def rich_run(tmp_path):
    run = str(tmp_path / "rich")
    reg = make_registry()
    reg.add("local", _Local())
    train(reg, 2)
    reg.get("counters").epoch = 1
    save(CheckpointStore(run), reg)
    return run


def test_inspect_json(rich_run, capsys):
    code, out, err = cli(capsys, "inspect", rich_run, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["path"] == ckpt(rich_run, 2)
    assert info["step"] == 2 and info["epoch"] == 0 and info["samples"] == 10
    assert info["world_size"] == 1
    assert info["saved_at"].endswith("Z") and isinstance(info["saved_at_unix"], float)
    assert info["versions"]["torch"] == torch.__version__
    assert set(info["versions"]) == {"unbroken", "torch", "python"}
    assert info["checked"] == "checksums"
    comps = info["components"]
    assert {k: (v["kind"], v["rank_local"]) for k, v in comps.items()} == {
        "counters": ("counters", False),
        "local": ("stateful", True),
        "model": ("module", False),
        "optimizer": ("optimizer", False),
        "rng": ("rng", True),
        "scheduler": ("stateful", False),
    }
    model = {t["name"]: t for t in comps["model"]["tensors"]}
    assert model["0.weight"] == {
        "name": "0.weight",
        "shape": [8, 4],
        "dtype": "float32",
        "bytes": 128,
    }
    assert model["2.bias"]["shape"] == [2]
    assert comps["model"]["tensor_bytes"] == (32 + 8 + 16 + 2) * 4
    assert len(comps["optimizer"]["tensors"]) == 12
    assert comps["local"]["tensors"] == [
        {"name": "buf", "shape": [2, 3], "dtype": "int64", "bytes": 48, "rank": 0}
    ]
    counters = info["counters"]["counters"]
    assert counters["step"] == 2 and counters["samples"] == 10 and counters["epoch"] == 1
    assert set(info["files"]) == {
        "tensors.json",
        "tensors-r00000.bin",
        "state.json",
        "rank-00000.json",
    }


def test_inspect_table(rich_run, capsys):
    code, out, err = cli(capsys, "inspect", ckpt(rich_run, 2))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["checkpoint", ckpt(rich_run, 2)]
    assert ["step", "2"] in [ln.split() for ln in lines]
    assert ["world", "size", "1"] in [ln.split() for ln in lines]
    counters = next(ln for ln in lines if ln.startswith("counters"))
    assert "step=2" in counters and "samples=10" in counters and "epoch=1" in counters
    rows = [ln.split() for ln in lines]
    assert ["NAME", "KIND", "RANK-LOCAL", "TENSORS", "SIZE"] in rows
    assert ["model", "module", "no", "4", "232", "B"] in rows
    assert ["rng", "rng", "yes", "0", "0", "B"] in rows
    assert ["0.weight", "[8,", "4]", "float32"] in rows
    assert ["state/0.weight/exp_avg_sq", "[8,", "4]", "float32"] in rows
    assert ["NAME", "SHAPE", "DTYPE", "RANK"] in rows
    assert ["buf", "[2,", "3]", "int64", "0"] in rows


def test_inspect_run_dir_falls_back_past_a_corrupt_one(run, capsys):
    flip(os.path.join(ckpt(run, 3), "state.json"))
    code, out, err = cli(capsys, "inspect", run, "--json")
    assert code == 0
    assert json.loads(out)["step"] == 2
    assert "warning" in err and ckpt(run, 3) in err and "state.json" in err


def test_inspect_step(run, capsys):
    code, out, _ = cli(capsys, "inspect", run, "--step", "1", "--json")
    assert code == 0 and json.loads(out)["step"] == 1
    code, _, err = cli(capsys, "inspect", run, "--step", "7")
    assert code == 3 and "found steps [1, 2, 3]" in err
    flip(os.path.join(ckpt(run, 2), "tensors.json"))
    code, _, err = cli(capsys, "inspect", run, "--step", "2")
    assert code == 1 and "tensors.json does not match its xxh3 checksum" in err
    code, _, err = cli(capsys, "inspect", ckpt(run, 1), "--step", "1")
    assert code == 2 and "--step applies to a run directory" in err


def test_inspect_exit_codes(run, tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    code, _, err = cli(capsys, "inspect", str(tmp_path / "empty"))
    assert code == 3 and "no valid checkpoint" in err
    code, _, err = cli(capsys, "inspect", str(tmp_path / "missing"))
    assert code == 3
    os.remove(os.path.join(ckpt(run, 3), "manifest.json"))
    code, _, err = cli(capsys, "inspect", ckpt(run, 3))
    assert code == 1 and "manifest.json is missing" in err
    flip(os.path.join(ckpt(run, 2), "tensors-r00000.bin"))
    code, _, err = cli(capsys, "inspect", ckpt(run, 2))
    assert code == 1 and "tensors-r00000.bin does not match its xxh3 checksum" in err
    code, _, _ = cli(capsys, "inspect", ckpt(run, 2), "--no-verify")
    assert code == 0


def test_inspect_run_dir_whose_every_checkpoint_is_corrupt_exits_3(run, capsys):
    # As `ls` and the documented codes: 3 is "no valid checkpoint"; each one's cause is named.
    for s in (1, 2, 3):
        flip(os.path.join(ckpt(run, s), "state.json"))
    code, out, err = cli(capsys, "inspect", run)
    assert code == 3 and out == ""
    assert "no valid checkpoint" in err
    for s in (1, 2, 3):
        assert ckpt(run, s) in err
    assert all(os.path.isdir(ckpt(run, s)) for s in (1, 2, 3))  # nothing was removed


def test_inspect_never_reads_tensor_data(run, capsys, monkeypatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(TensorReader, "read_data", refuse)
    monkeypatch.setattr(_direct.VerifiedReads, "into", refuse)
    monkeypatch.setattr(CheckpointReader, "load_tensors", refuse)
    code, out, err = cli(capsys, "inspect", run, "--json")
    assert code == 0, err
    assert json.loads(out)["step"] == 3


def test_entry_point(run):
    proc = subprocess.run(
        [sys.executable, "-m", "unbroken", "ls", run, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in json.loads(proc.stdout)] == [3, 2, 1]
    helptext = build_parser().format_help()
    assert "ls" in helptext and "inspect" in helptext


LS_WITHOUT_TORCH = """
import sys
from unbroken.cli import main
code = main(["ls", *sys.argv[1:]])
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code, file=sys.stderr)
"""


@pytest.mark.parametrize("verify", ["checksums", "sizes"])
def test_ls_does_not_import_torch(run, verify):
    """``unbroken ls`` reads manifests, the bounded tensor tables and checksums: it needs dtype
    names and their sizes, not torch (whose import is seconds on a loaded machine). A corrupt
    checkpoint and a pinned one are listed too."""
    CheckpointStore(run).pin(1)
    flip(os.path.join(ckpt(run, 3), "tensors-r00000.bin"))
    argv = [run, "--json"] + (["--no-verify"] if verify == "sizes" else [])
    proc = subprocess.run(
        [sys.executable, "-c", LS_WITHOUT_TORCH, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.stderr.strip().endswith("NO-TORCH 0"), proc.stderr
    rows = {r["step"]: r for r in json.loads(proc.stdout)}
    assert sorted(rows) == [1, 2, 3]
    assert rows[3]["valid"] is (verify == "sizes") and rows[2]["valid"] and rows[1]["pinned"]


INSPECT_WITHOUT_TORCH = """
import contextlib, io, json, sys
from unbroken.cli import main
for argv in ([sys.argv[1]], [sys.argv[1], "--json"]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["inspect", *argv]) == 0
print(json.loads(out.getvalue())["step"], "torch" in sys.modules)
"""


def test_inspect_does_not_import_torch(rich_run):
    """``inspect`` of a format 2 checkpoint shows shapes and dtypes from the table's columns
    (dtype names), so it does not import torch either."""
    proc = subprocess.run(
        [sys.executable, "-c", INSPECT_WITHOUT_TORCH, rich_run],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.stdout.split() == ["2", "False"], proc.stderr
