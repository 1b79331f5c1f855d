"""Every ```python block of README.md and docs/*.md runs as written; every one that trains through
``unbroken.Run`` passes ``unbroken verify`` as written (killed, relaunched, compared bit for bit);
the quickstart resumes exactly.

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
ALL = [
    (f"{page.name}#{i}", code)
    for page in PAGES
    for i, code in enumerate(FENCE.findall(page.read_text()))
]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# The run directory of a block that trains: one literal Run("DIR", ...) (or verify's own
# variable), a loop and run.step().
RUN_DIR = re.compile(r"unbroken\.Run\(\s*(\"[^\"]+\"|os\.environ\[\"UNBROKEN_RUN_DIR\"\])")
# Blocks that train but are not one resumable training script, and why. (The framework blocks
# of integrations.md build no Run of their own: their golden tests are
# tests/e2e/test_integration_*.)
NOT_VERIFIED = {
    "resume.md#3": "damages its own checkpoint to show the error and start_over",
    "trackers.md#2": "runs two launches in one process and asserts its own hook log",
    "verify.md#0": "runs unbroken.verify_resume itself, on the script it writes",
}


def _trains(code: str) -> bool:
    return len(set(RUN_DIR.findall(code))) == 1 and "run.step(" in code


TRAINING = [(i, c) for i, c in ALL if _trains(c) and i not in NOT_VERIFIED]
BLOCKS = [pytest.param(code, id=i) for i, code in ALL if (i, code) not in TRAINING]


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


# Runs a block as written from a working directory of its own where the block's literal run
# directory is a symlink to the one verify gives each run.
_IN_RUN_DIR = """
import os, sys
run_dir, literal = os.environ["UNBROKEN_RUN_DIR"], sys.argv[2]
home = run_dir + ".cwd"
os.makedirs(run_dir, exist_ok=True)
if literal != "-" and not os.path.lexists(os.path.join(home, literal)):
    os.makedirs(os.path.dirname(os.path.join(home, literal)) or home, exist_ok=True)
    os.symlink(run_dir, os.path.join(home, literal))
os.makedirs(home, exist_ok=True)
os.chdir(home)
code = open(sys.argv[1]).read()
exec(compile(code, sys.argv[1], "exec"), {"__name__": "__main__"})
"""


@pytest.mark.parametrize("block", [pytest.param(c, id=i) for i, c in TRAINING])
def test_block_passes_verify(block: str, tmp_path: Path) -> None:
    import unbroken

    literal = RUN_DIR.search(block).group(1)  # type: ignore[union-attr]
    literal = literal.strip('"') if literal.startswith('"') else "-"
    script = tmp_path / "block.py"
    script.write_text(block)
    cmd = [sys.executable, "-c", _IN_RUN_DIR, str(script), literal]
    report = unbroken.verify_resume(cmd, interrupts=1, seed=0, work_dir=tmp_path / "verify")
    assert report.passed, report.summary()


def test_the_training_blocks_are_found() -> None:
    ids = [i for i, _ in TRAINING]
    assert "README.md#0" in ids and len(ids) >= 6, ids
    assert set(NOT_VERIFIED) <= {i for i, _ in ALL}, "a NOT_VERIFIED block no longer exists"


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
    # The quickstart seeds every global stream (unbroken.seed_everything), so all of it is equal.
    assert_identical(ref / "runs" / "quickstart", cut / "runs" / "quickstart")
    # A completed run relaunched does no more steps.
    again = subprocess.run([sys.executable, "-c", code], cwd=cut, env=ENV, timeout=120)
    assert again.returncode == 0
    assert _records(cut / "runs" / "quickstart") == 40
