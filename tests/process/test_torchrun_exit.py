"""A finished multi-rank run exits 0 on every rank, whatever the backend's teardown does.

examples/char_lm.py (DDP, 2 DataLoader workers per rank, no destroy_process_group() or os._exit
of its own) under torchrun with 2 gloo ranks, to completion: torchrun must report success. The
library's exit (unbroken._dist.clean_exit) keeps gloo's teardown from aborting a rank at
interpreter exit ("terminate called without an active exception", -6), which would make
torchrun kill the other rank and fail a run that wrote its final weights.
``scripts/torchrun_exits.py`` does the same 20 times in a row.
"""

from __future__ import annotations

from pathlib import Path

from tests.golden import ROOT
from tests.torchrun_helpers import finish, start, torchrun

EXAMPLE = ROOT / "examples" / "char_lm.py"


def test_char_lm_under_torchrun_exits_0_on_every_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = torchrun("--run-dir", str(run_dir), "--steps", "4", "--save-every", "2", script=EXAMPLE)
    code, out = finish(start(cmd))
    assert code == 0, out[-4000:]
    assert "terminate called" not in out and "Traceback" not in out, out[-4000:]
    assert (run_dir / "final.safetensors").exists()
