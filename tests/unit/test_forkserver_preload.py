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


def test_shared_servers_are_one_per_interpreter_threads_and_preloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside ``shared()`` verifications of the same interpreter, OpenMP thread count and
    preloads get the one server, not theirs to close; it is closed when the block ends. Outside
    it each gets a server of its own to close."""
    from unbroken.verify import _forkserver

    made: list[object] = []

    class Fake:
        def __init__(self, *args: object) -> None:
            self.closed = False
            made.append(self)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(_forkserver, "ForkServer", Fake)
    one = {"OMP_NUM_THREADS": "1"}
    with _forkserver.shared():
        a, a_owned = _forkserver.server_for("py", one, "log-a", ["transformers"])
        b, b_owned = _forkserver.server_for("py", {**one, "X": "other"}, "log-b", ["transformers"])
        c, _ = _forkserver.server_for("py", {"OMP_NUM_THREADS": "2"}, "log-c", ["transformers"])
        d, _ = _forkserver.server_for("py", one, "log-d", [])
        with _forkserver.shared():  # nested: the same servers, closed by the outer block
            assert _forkserver.server_for("py", one, "log-e", [])[0] is d
        assert a is b and not a_owned and not b_owned
        assert len({id(a), id(c), id(d)}) == 3
        assert not any(s.closed for s in made)  # type: ignore[attr-defined]
    assert len(made) == 3 and all(s.closed for s in made)  # type: ignore[attr-defined]
    e, e_owned = _forkserver.server_for("py", one, "log-f", [])
    assert e_owned and e not in made[:3]
