"""``unbroken export``, ``average``, ``diff`` and ``plot`` on real checkpoints written by real
training processes: a toy run, the same run killed and resumed, and a 2-rank FSDP2 run whose
checkpoint is sharded. Tensors are read back only through the store's reader API."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import unbroken
from tests.dist_launch import launch as launch_ranks
from tests.golden import ROOT, launch, run_interrupted
from unbroken.cli import main
from unbroken.store import CheckpointReader, CheckpointStore

TOY = ROOT / "tests" / "scripts" / "toy_train.py"
TOY_DIST = ROOT / "tests" / "scripts" / "toy_dist.py"
ARGS = ["--steps", "12", "--save-every", "3"]  # checkpoints 3, 6, 9, 12; keep_last 3 keeps 6-12


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    ref, resumed = root / "ref", root / "resumed"
    assert launch(TOY, [*ARGS, "--run-dir", str(ref)]) == 0
    run_interrupted(TOY, ARGS, resumed, [(7, "KILL")])  # checkpoint 6, steps 7 redone
    return {"ref": ref, "resumed": resumed}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 2-rank FSDP2 run (sharded checkpoint at step 4) and, from a second 2-rank launch
    that resumed it, the full model and EMA tensors each rank gathered after loading."""
    root = tmp_path_factory.mktemp("fsdp")
    run, dump = root / "run", root / "dump.safetensors"
    common = ["--run-dir", str(run), "--mode", "fsdp", "--steps", "4", "--save-every", "2"]
    assert launch_ranks(TOY_DIST, common, 2)[0] == [0, 0]
    assert launch_ranks(TOY_DIST, [*common, "--dump-after-load", str(dump)], 2)[0] == [0, 0]
    return run, dump


def cli(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def stored(reader: CheckpointReader, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose stored name starts with ``prefix``, keyed by the rest."""
    infos = {k: i for k, i in reader.tensor_infos().items() if k.startswith(prefix)}
    targets = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in infos.items()}
    reader.load_tensors(targets)
    return {k.removeprefix(prefix): v for k, v in targets.items()}


def latest(run: Path) -> CheckpointReader:
    reader = CheckpointStore(str(run)).latest()
    assert reader is not None
    return reader


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---- export -----------------------------------------------------------------------------------


def test_export_safetensors_model_and_ema(runs, tmp_path, capsys) -> None:
    reader = latest(runs["ref"])
    out = tmp_path / "model.safetensors"
    code, text, err = cli(capsys, "export", runs["ref"], "--to", "safetensors", "--out", out)
    assert code == 0, err
    assert f"{out}: 4 tensors of model at step 12" in text
    model = stored(reader, "model/")
    assert_same(load_file(out), model)
    probe = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    probe.load_state_dict(load_file(out))  # loads as is into the model it came from
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["unbroken_step"] == "12"

    ema_out = tmp_path / "ema.safetensors"
    code, text, _ = cli(
        capsys, "export", reader.path, "--ema", "--to", "safetensors", "--out", ema_out, "--json"
    )
    assert code == 0
    info = json.loads(text)
    assert info["component"] == "ema" and info["ema"] and info["step"] == 12
    assert info["files"] == [str(ema_out)] and info["tensors"] == 4
    ema = load_file(ema_out)
    assert_same(ema, stored(reader, "ema/shadow/"))
    assert not all(torch.equal(ema[k], model[k]) for k in ema)  # really the EMA


def test_export_hf_shards_with_an_index(runs, tmp_path, capsys) -> None:
    reader = CheckpointStore(str(runs["ref"])).open(9)
    out = tmp_path / "hf"
    code, text, err = cli(
        capsys, "export", runs["ref"], "--step", 9, "--to", "hf", "--out", out,
        "--max-shard-size", "600B", "--json",
    )  # fmt: skip
    assert code == 0, err
    info = json.loads(text)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert sorted(set(index["weight_map"].values())) == shards
    merged: dict[str, torch.Tensor] = {}
    for name in shards:
        part = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in part)
        merged |= part
    model = stored(reader, "model/")
    assert_same(merged, model)
    total = sum(t.numel() * t.element_size() for t in model.values())
    assert index["metadata"]["total_size"] == total == info["bytes"]

    (out / "config.json").write_text("{}")  # the user's own file stays
    assert cli(capsys, "export", runs["ref"], "--to", "hf", "--out", out)[0] == 0
    # Fits one shard: no index, and the earlier export's shards and index are gone.
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_same(load_file(out / "model.safetensors"), stored(latest(runs["ref"]), "model/"))


def test_export_consolidates_a_two_rank_sharded_checkpoint(fsdp, tmp_path, capsys) -> None:
    run, dump = fsdp
    reader = latest(run)
    assert reader.world_size == 2 and reader.step == 4
    full = load_file(dump)
    for flag, prefix in (("", "model/"), ("--ema", "ema/shadow/")):
        out = tmp_path / f"out{flag}.safetensors"
        argv = ["export", run, "--to", "safetensors", "--out", out] + ([flag] if flag else [])
        code, _, err = cli(capsys, *argv)
        assert code == 0, err
        want = {k.removeprefix(prefix): v for k, v in full.items() if k.startswith(prefix)}
        assert_same(load_file(out), want)


def test_export_errors_name_the_file(runs, tmp_path, capsys) -> None:
    missing = tmp_path / "nope"
    code, _, err = cli(capsys, "export", missing, "--to", "safetensors")
    assert code == 3 and str(missing) in err
    code, _, err = cli(capsys, "export", runs["ref"], "--to", "hf", "--component", "optimizer")
    assert code == 2 and "'optimizer'" in err and "not a state dict of tensors" in err
    code, _, err = cli(capsys, "export", runs["ref"], "--to", "hf", "--component", "nosuch")
    assert code == 2 and "no global component 'nosuch'" in err and "model" in err
    code, _, err = cli(capsys, "export", runs["ref"], "--to", "hf", "--component", "model", "--ema")
    assert code == 2 and "is not an unbroken.EMA" in err
    unwritable = tmp_path / "no-such-dir" / "m.safetensors"
    code, _, err = cli(capsys, "export", runs["ref"], "--to", "safetensors", "--out", unwritable)
    assert code == 1 and f"cannot write {unwritable}" in err
    # A flipped bit in the largest file of the newest checkpoint: refused, naming the file.
    run = tmp_path / "run"
    shutil.copytree(runs["ref"], run)
    ckpt = Path(latest(run).path)
    victim = max(ckpt.iterdir(), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    code, _, err = cli(capsys, "export", ckpt, "--to", "safetensors", "--out", tmp_path / "x")
    assert code == 1 and victim.name in err
    assert not (tmp_path / "x").exists()


# ---- average ----------------------------------------------------------------------------------


def hand_mean(readers: list[CheckpointReader], prefix: str) -> dict[str, torch.Tensor]:
    """The documented order: float64 sum in ascending step order, / N, back to the dtype."""
    parts = [stored(r, prefix) for r in sorted(readers, key=lambda r: r.step)]
    out = {}
    for k, t in parts[-1].items():
        acc = torch.zeros(t.shape, dtype=torch.float64)
        for p in parts:
            acc += p[k].double()
        out[k] = (acc / len(parts)).to(t.dtype)
    return out


@pytest.mark.parametrize("ema", [False, True])
def test_average_equals_the_mean_by_hand_bitwise(runs, tmp_path, capsys, ema: bool) -> None:
    store = CheckpointStore(str(runs["ref"]))
    readers = [store.open(s) for s in (6, 9, 12)]
    out = tmp_path / "avg.safetensors"
    argv = ["average", runs["ref"], "--last", 3, "--out", out, "--json"]
    code, text, err = cli(capsys, *argv, *(["--ema"] if ema else []))
    assert code == 0, err
    info = json.loads(text)
    assert info["steps"] == [6, 9, 12] and "ascending step order" in info["order"]
    prefix = "ema/shadow/" if ema else "model/"
    mean = load_file(out)
    assert_same(mean, hand_mean(readers, prefix))
    newest = stored(readers[-1], prefix)
    assert not any(torch.equal(mean[k], newest[k]) for k in mean)  # it did average
    assert_same(load_file(out), hand_mean(readers[::-1], prefix))  # order is by step, not input


def test_average_of_one_is_the_checkpoint_and_too_many_is_exit_3(runs, tmp_path, capsys) -> None:
    out = tmp_path / "one.safetensors"
    assert cli(capsys, "average", runs["ref"], "--last", 1, "--out", out)[0] == 0
    assert_same(load_file(out), stored(latest(runs["ref"]), "model/"))
    code, _, err = cli(capsys, "average", runs["ref"], "--last", 4, "--out", out)
    assert code == 3 and "3 valid checkpoint(s), fewer than --last 4" in err
    assert cli(capsys, "average", runs["ref"], "--last", 0)[0] == 2


# ---- diff -------------------------------------------------------------------------------------


def test_diff_resumed_run_equals_the_uninterrupted_one(runs, capsys) -> None:
    code, text, err = cli(capsys, "diff", runs["ref"], runs["resumed"], "--json")
    report = json.loads(text)
    # Only the counters' wall-clock fields differ between the two (train_seconds, the log offset).
    assert code == 1 and report["first_difference"]["component"] == "counters"
    assert report["first_differing_tensor"] is None
    assert {n for n, c in report["components"].items() if c["status"] != "equal"} == {"counters"}
    keys = {d["key"] for d in report["components"]["counters"]["differences"]}
    assert keys <= {"train_seconds", "metrics_offset"}
    code, text, _ = cli(capsys, "diff", runs["ref"], runs["resumed"], "--ignore", "counters")
    assert code == 0 and "IDENTICAL (bitwise)" in text
    assert "model      equal (4 tensors)" in text


def test_diff_names_the_first_differing_tensor(runs, capsys) -> None:
    store = CheckpointStore(str(runs["ref"]))
    a, b = store.open(9).path, store.open(12).path
    code, text, _ = cli(capsys, "diff", a, b, "--ignore", "counters", "--json")
    report = json.loads(text)
    assert code == 1 and not report["identical"]
    first = report["first_differing_tensor"]
    assert first["component"] == "ema" and first["key"] == "shadow.0.bias"  # name order
    assert "max |Δ|" in first["detail"]
    model = report["components"]["model"]
    assert model["tensors"] == model["tensors_differing"] == 4
    code, text, _ = cli(capsys, "diff", a, b)
    assert code == 1 and "first differing tensor: ema: shadow.0.bias" in text


def test_diff_tolerances(tmp_path, capsys) -> None:
    def saved(name: str, bump: float) -> str:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            model.weight[1, 2] += bump
        run = unbroken.Run(tmp_path / name, model=model, progress=False)
        path = run.save()
        run.close()
        return str(path)

    a, b = saved("a", 0.0), saved("b", 1e-6)
    code, text, _ = cli(capsys, "diff", a, b, "--ignore", "counters")
    assert code == 1 and "first difference model: weight" in text and "1 of 6 elements" in text
    assert cli(capsys, "diff", a, b, "--ignore", "counters", "--atol", "1e-5")[0] == 0
    assert cli(capsys, "diff", a, b, "--ignore", "counters", "--atol", "1e-8")[0] == 1
    assert cli(capsys, "diff", a, b, "--ignore", "counters", "--rtol", "1e-3")[0] == 0
    code, _, err = cli(capsys, "diff", a, b, "--atol", "-1")
    assert code == 2 and "--atol" in err
    code, _, err = cli(capsys, "diff", a, tmp_path / "missing")
    assert code == 3 and "missing" in err


# ---- plot -------------------------------------------------------------------------------------


def test_plot_marks_the_resume(runs, tmp_path, capsys) -> None:
    out = tmp_path / "m.png"
    code, text, err = cli(capsys, "plot", runs["resumed"], "--out", out, "--json")
    assert code == 0, err
    info = json.loads(text)
    assert info["keys"][0] == "loss" and "lr" in info["keys"]
    assert info["steps"] == 12 and info["resumes"] == [6]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    code, _, err = cli(capsys, "plot", runs["resumed"], "--keys", "loss,accuracy")
    assert code == 2 and "accuracy" in err and "loss" in err
    code, _, err = cli(capsys, "plot", tmp_path / "nope")
    assert code == 3 and "metrics.jsonl" in err


def test_tools_agree_on_the_uninterrupted_and_the_resumed_run(runs, tmp_path, capsys) -> None:
    """The golden check through the tools: the run killed after step 7 and resumed exports and
    averages (checkpoint 6 written before the kill, 9 and 12 after it) to the same bits."""
    files = {}
    for name in ("ref", "resumed"):
        avg, exp = tmp_path / f"{name}-avg.safetensors", tmp_path / f"{name}-ema.safetensors"
        assert cli(capsys, "average", runs[name], "--last", 3, "--ema", "--out", avg)[0] == 0
        assert (
            cli(capsys, "export", runs[name], "--ema", "--to", "safetensors", "--out", exp)[0] == 0
        )
        files[name] = (load_file(avg), load_file(exp))
    for a, b in zip(files["ref"], files["resumed"], strict=True):
        assert_same(a, b)
