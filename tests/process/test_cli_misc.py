"""The demo (a short one), pin/unpin, char_lm under torchrun, and SLURM's environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import unbroken
from tests.dist_launch import free_port
from tests.golden import ROOT
from unbroken.cli import main

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_demo_runs_and_reports_identical(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken",
            "demo",
            "--out",
            str(out),
            "--steps",
            "12",
            "--save-every",
            "3",
            "--kills",
            "2",
            "--seed",
            "3",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT: bit-for-bit identical" in proc.stdout
    # Two interrupted launches (verify_resume's plan: one SIGKILL inside a save), one to the end.
    assert re.search(r"launches +1 +3 \(\d SIGKILL, \d SIGTERM; [12] during a save\)", proc.stdout)
    report = json.loads((out / "report.json").read_text())
    assert report["identical"] and report["tensors_equal"] == report["tensors"] > 0
    assert report["steps"] == [12, 12]
    assert report["verify"]["passed"] and report["verify"]["checkpoints_compared"] == [3, 6, 9, 12]
    assert (out / "reference" / "final.safetensors").is_file()
    assert (out / "demo.png").stat().st_size > 10_000


def test_pin_and_unpin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    model = torch.nn.Linear(2, 2)
    run = unbroken.Run(tmp_path, model=model, progress=False)
    run.save()
    run.close()
    assert main(["pin", str(tmp_path), "0"]) == 0
    assert (tmp_path / "checkpoints" / "step-000000000" / ".pinned").exists()
    assert main(["unpin", str(tmp_path), "0"]) == 0
    assert not (tmp_path / "checkpoints" / "step-000000000" / ".pinned").exists()
    assert main(["pin", str(tmp_path), "7"]) == 3
    assert "no checkpoint for step 7" in capsys.readouterr().err


def test_char_lm_under_torchrun(tmp_path: Path) -> None:
    """The example's contract on 2 ranks: trace written once, samples = the global batch."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(ROOT / "examples" / "char_lm.py"),
            "--run-dir",
            str(tmp_path),
            "--steps",
            "3",
            "--save-every",
            "2",
            "--workers",
            "0",
            "--batch-size",
            "8",
            "--context",
            "16",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trace] == [1, 2, 3]
    assert all(len(r["samples"]) == 8 == r["batch_size"] for r in trace)
    manifest = json.loads(next((tmp_path / "checkpoints").glob("step-*/manifest.json")).read_text())
    assert manifest["world_size"] == 2
    assert {"rank-00000.json", "rank-00001.json"} <= manifest["files"].keys()


def test_init_distributed_reads_slurm_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # init_distributed writes RANK/WORLD_SIZE/LOCAL_RANK itself; setenv first so that monkeypatch
    # records them and restores their absence (a leaked WORLD_SIZE=2 breaks later launches).
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert unbroken.init_distributed() == (0, 1)
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.delenv("RANK")
    with pytest.raises(unbroken.ConfigError, match="MASTER_ADDR"):
        unbroken.init_distributed()
