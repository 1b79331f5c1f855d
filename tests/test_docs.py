"""Every ```python block of README.md and docs/*.md runs as written; the quickstart resumes exactly.

Blocks are executed one per fresh process in an empty temporary directory. Illustrative fragments
that are not meant to run use another fence (```text, ```bash).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import ROOT, assert_identical

FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    pytest.param(code, id=f"{page.name}#{i}")
    for page in PAGES
    for i, code in enumerate(FENCE.findall(page.read_text()))
]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _quickstart() -> str:
    return FENCE.findall((ROOT / "README.md").read_text())[0]


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs(code: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    env = ENV
    if "s3://my-bucket" in code:  # docs/remote.md: against the tests' S3 server
        request.getfixturevalue("s3")
        from tests._s3server import make_bucket

        make_bucket("my-bucket")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the fixture's AWS_* variables
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


# Slows each step down a little so the test can interrupt the quickstart mid-run; the
# quickstart's own lines run unchanged.
_SLOW = """
import time, unbroken
_step = unbroken.Run.step
def _slow_step(self, *a, **k):
    time.sleep(0.03)
    return _step(self, *a, **k)
unbroken.Run.step = _slow_step
"""


def _records(run_dir: Path) -> int:
    try:
        return sum(1 for line in open(run_dir / "metrics.jsonl") if '"event"' not in line)
    except FileNotFoundError:
        return 0


def test_quickstart_resumes_exactly(tmp_path: Path) -> None:
    code = _SLOW + _quickstart()
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    ref.mkdir()
    cut.mkdir()
    subprocess.run([sys.executable, "-c", code], cwd=ref, env=ENV, check=True, timeout=120)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=cut, env=ENV, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while _records(cut / "runs" / "quickstart") < 13 and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err.decode()[-2000:]
    assert b"relaunch" in err
    second = subprocess.run(
        [sys.executable, "-c", code], cwd=cut, env=ENV, timeout=120, capture_output=True
    )
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    # The quickstart seeds torch only; Python's and NumPy's (unused) streams start from OS
    # entropy in each process, so their saved states legitimately differ.
    assert_identical(ref / "runs" / "quickstart", cut / "runs" / "quickstart", ignore=("rng",))
    # A completed run relaunched does no more steps.
    again = subprocess.run([sys.executable, "-c", code], cwd=cut, env=ENV, timeout=120)
    assert again.returncode == 0
    assert _records(cut / "runs" / "quickstart") == 40
