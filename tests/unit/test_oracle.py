"""The oracle the golden tests trust (tests/golden.py ``oracle_identical``) can fail: a last bit
of one tensor, one value, one step's loss, or a record on one side only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.golden import oracle_identical


def _record(run: Path, weight: torch.Tensor, step: int = 3, losses: int = 3) -> Path:
    folder = run / "oracle"
    folder.mkdir(parents=True)
    save_file({"model/w": weight}, str(folder / "final.safetensors"))
    (folder / "final.json").write_text(json.dumps({"optimizer/state/step": step}))
    lines = [f"{s} {float(s) / 7:.17g}" for s in range(1, losses + 1)]
    (folder / "losses.txt").write_text("".join(f"{line}\n" for line in lines))
    return run


def test_two_equal_records_pass_and_no_record_says_so(tmp_path: Path) -> None:
    w = torch.linspace(0, 1, 5)
    assert oracle_identical(_record(tmp_path / "a", w), _record(tmp_path / "b", w.clone()))
    assert not oracle_identical(tmp_path / "c", tmp_path / "d")


@pytest.mark.parametrize("change", ["last bit", "value", "one loss less", "one side only"])
def test_each_difference_fails(tmp_path: Path, change: str) -> None:
    w = torch.linspace(0, 1, 5)
    ref = _record(tmp_path / "a", w)
    if change == "last bit":
        other = w.clone()
        other.view(torch.int32)[2] ^= 1
        run = _record(tmp_path / "b", other)
    elif change == "value":
        run = _record(tmp_path / "b", w, step=4)
    elif change == "one loss less":
        run = _record(tmp_path / "b", w, losses=2)
    else:
        run = tmp_path / "b"
    with pytest.raises(AssertionError):
        oracle_identical(ref, run)
