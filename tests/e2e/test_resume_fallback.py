"""One-pass verified resume: a checkpoint whose tensor bytes fail their checksum *during* the
load is replaced by the previous one, loaded over the live tensors, and the run ends exactly.

The data file's bytes are changed where no whole-file check before the load can see it (the
manifest's checksum of a data file is its chunks' checksums, which stay as written): only the
per-chunk verification while reading can catch it. Real processes: a trainer SIGKILLed after
its step-8 save, the byte flipped, a fresh process resumes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.golden import ROOT, assert_identical, launch
from unbroken.store import CheckpointStore

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"
ARGS = ["--steps", "12", "--save-every", "4"]


def test_a_chunk_failing_while_loading_falls_back_to_the_previous_checkpoint(tmp_path: Path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(ref)]) == 0
    code = launch(SCRIPT, [*ARGS, "--run-dir", str(run), "--signal-at", "9", "--signal", "KILL"])
    assert code == -9
    step8 = CheckpointStore(str(run)).open(8).path
    with open(os.path.join(step8, "tensors.json")) as f:
        chunk = json.load(f)["tensors"]["model/0.weight"]["chunks"][0]
    with open(os.path.join(step8, "tensors-r00000.bin"), "r+b") as f:
        f.seek(chunk["offset"] + 5)
        b = f.read(1)
        f.seek(chunk["offset"] + 5)
        f.write(bytes([b[0] ^ 0x10]))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *ARGS, "--run-dir", str(run)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed its checksums while loading" in proc.stderr, proc.stderr[-3000:]
    assert "model/0.weight" in proc.stderr
    kept = os.listdir(run / "checkpoints")
    assert any(n.startswith("unusable-step-000000008") for n in kept), kept  # not deleted
    assert_identical(ref, run)
