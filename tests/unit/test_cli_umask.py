"""Files written by ``unbroken export`` and ``unbroken average`` honour the umask, like any file
a user writes: on a shared machine, colleagues in the group read exported weights when the
umask lets them (safetensors itself creates its files 0600 whatever the umask)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests._store_helpers import make_run
from unbroken.cli import main


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_export_and_average_honour_the_umask(tmp_path: Path, mask: int, capsys) -> None:
    run = tmp_path / "run"
    make_run(str(run), steps=(1, 2))
    out = tmp_path / "out"
    out.mkdir()
    single, hf, avg = out / "m.safetensors", out / "hf", out / "avg.safetensors"
    with umask(mask):
        assert main(["export", str(run), "--to", "safetensors", "--out", str(single)]) == 0
        # Tiny shards: several files and an index.
        argv = ["export", str(run), "--to", "hf", "--out", str(hf), "--max-shard-size", "64"]
        assert main(argv) == 0
        assert main(["average", str(run), "--last", "2", "--out", str(avg)]) == 0
    capsys.readouterr()
    files = [single, avg, *sorted(hf.iterdir())]
    assert len(files) > 3 and any(f.name.endswith(".index.json") for f in files)
    want = 0o666 & ~mask
    assert {f.name: oct(_mode(f)) for f in files} == {f.name: oct(want) for f in files}
    assert _mode(hf) == 0o777 & ~mask
