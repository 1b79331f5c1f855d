"""bench/gpu_check.py (the device check) runs where there is no GPU: it says so, measures
nothing and exits 0; with CUDA it is run by hand (minutes), never by the suite."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.golden import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, run bench/gpu_check.py itself")
def test_gpu_check_says_there_is_no_cuda():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "no CUDA: bench/gpu_check.py needs one GPU; nothing was measured"
    assert json.loads(lines[-1]) == {"bench": "gpu_check", "cuda": False}
