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


def test_one_parse_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify_resume called from a thread pool (tests/e2e/test_seeded_bugs.py does): CPython
    3.11's ast.parse, entered by two threads at once, failed every verification of the fixture
    with "SystemError: AST constructor recursion depth mismatch". Rare to provoke on purpose,
    so this checks the cure: no two threads parse at once."""
    import ast
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    inside, most, lock = 0, 0, threading.Lock()
    parse = ast.parse

    def slow_parse(*args: object, **kwargs: object) -> ast.Module:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.01)  # long enough for the other threads to come in
        try:
            return parse(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            with lock:
                inside -= 1

    monkeypatch.setattr(ast, "parse", slow_parse)
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: preloads(str(script)), range(16)))
    assert most == 1
    assert all(r == results[0] for r in results) and results[0]
