"""The determinism audit: a pure function of the torch settings (table-tested), its torch
boundary, and the opt-in helper; the real check on CUDA runs when CUDA is present."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import unbroken
from tests.golden import ROOT
from unbroken.train import _determinism
from unbroken.train._determinism import DeterminismSettings, problems

GOOD = DeterminismSettings(
    cuda=True,
    deterministic_algorithms=True,
    warn_only=False,
    cublas_workspace=":4096:8",
    cudnn_benchmark=False,
    cudnn_deterministic=True,
)


def with_(**kw) -> DeterminismSettings:
    return DeterminismSettings(**{**{f: getattr(GOOD, f) for f in GOOD.__slots__}, **kw})


@pytest.mark.parametrize(
    "change,named,fix",
    [
        ({"deterministic_algorithms": False}, "use_deterministic_algorithms is off", "(True)"),
        ({"warn_only": True}, "warn_only=True", "drop warn_only"),
        ({"cublas_workspace": None}, "CUBLAS_WORKSPACE_CONFIG is unset", "=:4096:8"),
        ({"cublas_workspace": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG is ':0:0'", "=:4096:8"),
        ({"cudnn_benchmark": True}, "cudnn.benchmark is on", "benchmark = False"),
        (
            {"deterministic_algorithms": False, "cudnn_deterministic": False},
            "cudnn.deterministic is off",
            "deterministic = True",
        ),
        ({"nccl_world": 3}, "NCCL reduces across 3 ranks", "NCCL_ALGO=Ring"),
    ],
    ids=["algorithms", "warn_only", "cublas_unset", "cublas_bad", "benchmark", "cudnn", "nccl"],
)
def test_each_setting_is_named_with_its_fix(change, named, fix):
    found = problems(with_(**change))
    assert any(named in p and fix in p for p in found), found


def test_all_set_or_no_cuda_is_clean():
    assert problems(GOOD) == []
    assert problems(with_(cublas_workspace=":16:8")) == []
    # cuDNN's own flag is implied by deterministic algorithms
    assert problems(with_(cudnn_deterministic=False)) == []
    bad = with_(deterministic_algorithms=False, cublas_workspace=None, cudnn_benchmark=True)
    assert len(problems(bad)) == 3
    bad = with_(
        deterministic_algorithms=False,
        cublas_workspace=None,
        cudnn_benchmark=True,
        cudnn_deterministic=False,
    )
    assert len(problems(bad)) == 4
    assert problems(with_(cuda=False, deterministic_algorithms=False, cudnn_benchmark=True)) == []
    # NCCL: 2 ranks add commutatively; a pinned algorithm reduces the same on any nodes.
    assert problems(with_(nccl_world=2)) == []
    assert problems(with_(nccl_world=8, nccl_algo="Ring")) == []


def test_read_settings_reads_torch_and_the_environment():
    s = _determinism.read_settings({"CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert s.cublas_workspace == ":16:8"
    assert s.deterministic_algorithms == torch.are_deterministic_algorithms_enabled()
    assert s.cudnn_benchmark == torch.backends.cudnn.benchmark
    assert s.cuda == (torch.cuda.is_available() and torch.cuda.is_initialized())


def test_make_deterministic_sets_what_the_audit_checks():
    """In a fresh process (it changes process-wide torch settings)."""
    code = (
        "import os, unbroken, torch\n"
        "from unbroken.train._determinism import read_settings, problems\n"
        "os.environ.pop('CUBLAS_WORKSPACE_CONFIG', None)\n"
        "torch.backends.cudnn.benchmark = True\n"
        "unbroken.make_deterministic()\n"
        "s = read_settings()\n"
        "assert s.deterministic_algorithms and not s.warn_only, s\n"
        "assert not s.cudnn_benchmark and s.cudnn_deterministic, s\n"
        "assert os.environ['CUBLAS_WORKSPACE_CONFIG'] == ':4096:8'\n"
        "import dataclasses\n"
        "assert problems(dataclasses.replace(s, cuda=True)) == []\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_warning_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(_determinism, "_warned", [])
    monkeypatch.setattr(
        _determinism, "read_settings", lambda environ=None: with_(cudnn_benchmark=True)
    )
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        assert len(_determinism.warn_determinism()) == 1
        _determinism.warn_determinism()
    assert caplog.text.count("cudnn.benchmark is on") == 1


def test_public():
    assert unbroken.train.determinism_problems is _determinism.determinism_problems
    assert unbroken.make_deterministic is _determinism.make_deterministic


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_cuda_settings_are_read():
    torch.zeros(1, device="cuda")
    assert _determinism.read_settings().cuda
