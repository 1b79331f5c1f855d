"""Which frameworks the fork server imports for a script (verify/_forkserver.py ``preloads``):
those of FRAMEWORKS the script imports at its top level, and nothing else -- importing a
module runs its code, so a script's own modules are never imported by the server."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.verify._forkserver import preloads

SCRIPT = """
import os
import torch
import pytorch_lightning as pl
from transformers import AutoConfig, Trainer
from accelerate.utils import set_seed
from . import sibling
import mymodule
from transformers import *

def main():
    import datasets  # not at the top: imported only when main() runs
"""


def test_the_scripts_top_level_framework_imports(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert preloads(str(script)) == [
        "pytorch_lightning",
        "transformers:AutoConfig,Trainer",
        "accelerate.utils:set_seed",
        "transformers",
    ]


@pytest.mark.parametrize("text", [None, "def broken(:\n", "\x00"])
def test_a_file_that_cannot_be_read_or_parsed_preloads_nothing(
    tmp_path: Path, text: str | None
) -> None:
    script = tmp_path / "train.py"
    if text is not None:
        script.write_text(text)
    assert preloads(str(script)) == []
