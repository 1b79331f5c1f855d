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
