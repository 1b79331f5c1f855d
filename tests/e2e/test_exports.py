"""The public face: a sorted __all__ whose every name resolves, and a torch-free import."""

from __future__ import annotations

import subprocess
import sys
import types

import unbroken
from tests.golden import ROOT


def test_all_is_sorted_and_complete() -> None:
    assert unbroken.__all__ == sorted(unbroken.__all__)
    for name in unbroken.__all__:
        assert getattr(unbroken, name) is not None, name
    public = {
        n
        for n in dir(unbroken)
        if not n.startswith("_") and not isinstance(getattr(unbroken, n), types.ModuleType)
    }
    assert public - {"annotations", "TYPE_CHECKING", "Any"} <= set(unbroken.__all__)


def test_import_and_cli_help_do_not_import_torch() -> None:
    code = (
        "import sys, unbroken; from unbroken.cli import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "False"


def test_export_weights_writes_tied_weights(tmp_path):
    """An LM head tied to its embedding (GPT-2 style) shares memory; both names are written."""
    import torch
    from safetensors.torch import load_file

    import unbroken

    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    unbroken.export_weights(tmp_path / "w.safetensors", model=model)
    got = load_file(tmp_path / "w.safetensors")
    assert torch.equal(got["model.emb.weight"], emb.weight.detach())
    assert torch.equal(got["model.head.weight"], emb.weight.detach())
