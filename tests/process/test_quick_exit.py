"""The quick exit after a stop (unbroken/process/_quick_exit.py): a stopped process skips the
interpreter's final collections and the native destructors, and loses nothing by it.

A script, in its own process group, is stopped by a SIGTERM to the whole group (as a scheduler
sends it; twice, 0.2 s apart) and relaunched to completion; the run is compared bit for bit
with an uninterrupted one. What the script left to the interpreter's exit must still happen: an
``atexit`` handler registered *before* ``import unbroken`` (it runs after unbroken's) and one
registered after ``Run()``, an unclosed file held only by a reference cycle (flushed by the
final collections otherwise), and a file a C library opened with ``fopen`` and never closed
(C's stdio buffer, which ``exit()`` flushes after its handlers, and ``_exit`` not at all). The
early handler reads ``gc.get_freeze_count()``: non-zero only when the quick exit ran before it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import ROOT, assert_identical, logged_steps
from unbroken import EXIT_RESUMABLE

STEPS = 30

_SCRIPT = r"""
import atexit, ctypes, gc, os, sys, time
OUT, RUN_DIR = sys.argv[1], sys.argv[2]
CRASH_AT = int(sys.argv[4]) if len(sys.argv) > 4 else None

def early():  # registered before `import unbroken`: runs after unbroken's exit handler
    with open(os.path.join(OUT, "early.txt"), "w") as f:
        f.write(str(gc.get_freeze_count()))

atexit.register(early)

import torch
import unbroken


class Journal:  # never closed; at teardown only its own cycle holds it
    def __init__(self, path):
        self.me = self
        self.f = open(path, "a")


journal = Journal(os.path.join(OUT, "journal.txt"))
libc = ctypes.CDLL(None)  # a C library's own FILE, never closed either
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.fputs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
c_journal = libc.fopen(os.path.join(OUT, "c-journal.txt").encode(), b"a")

g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
loader = unbroken.MapLoader(
    torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True, seed=1
)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
run = unbroken.Run(RUN_DIR, model=model, loader=loader, max_steps=int(sys.argv[3]),
                   progress=False, seed=0)
atexit.register(lambda: open(os.path.join(OUT, "late.txt"), "w").write("ran"))
for xb, yb in run.loop(loader):
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
            p.grad = None
    step = run.counters.step + 1
    journal.f.write(f"step {step}\n")
    libc.fputs(f"step {step}\n".encode(), c_journal)
    if step == CRASH_AT:
        raise RuntimeError(f"crash at step {step}")
    time.sleep(0.03)
    run.step(loss=loss)
"""


def _launch(
    tmp: Path, run_dir: Path, out: Path, *, stop_after: int | None, quick: bool = True
) -> int:
    out.mkdir(parents=True, exist_ok=True)
    script = tmp / "quick.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if not quick:
        env["UNBROKEN_QUICK_EXIT"] = "0"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), str(run_dir), str(STEPS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        if stop_after is not None:
            deadline = time.monotonic() + 120
            while len(logged_steps(run_dir)) < stop_after:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no progress"
                time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGTERM)  # every process of the job, as schedulers do
            time.sleep(0.2)
            try:  # and again, as an impatient scheduler or user does (the same stop)
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # already gone
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in stderr.decode(), stderr.decode()
    return proc.returncode


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "quick-off"])
def test_a_stopped_process_exits_quickly_and_keeps_what_the_exit_owes(tmp_path, quick):
    ref = tmp_path / "ref"
    assert _launch(tmp_path, ref, tmp_path / "ref-out", stop_after=None) == 0

    run_dir = tmp_path / "run"
    starts = [0]
    for attempt, stop_after in enumerate((5, 14)):
        out = tmp_path / f"out-{attempt}"
        code = _launch(tmp_path, run_dir, out, stop_after=stop_after, quick=quick)
        assert code == EXIT_RESUMABLE
        stopped = logged_steps(run_dir)[-1]
        trained = list(range(starts[-1] + 1, stopped + 1))
        starts.append(stopped)
        frozen = int((out / "early.txt").read_text())
        assert (frozen > 0) == quick, f"gc.get_freeze_count() at the early handler: {frozen}"
        assert (out / "late.txt").read_text() == "ran"
        journal = (out / "journal.txt").read_text().splitlines()
        assert journal == [f"step {s}" for s in trained], "the unclosed file lost its tail"
        c_journal = (out / "c-journal.txt").read_text().splitlines()
        assert c_journal == [f"step {s}" for s in trained], "C's stdio buffer was not flushed"

    assert _launch(tmp_path, run_dir, tmp_path / "out-last", stop_after=None) == 0
    assert_identical(ref, run_dir)


def test_a_run_that_completes_exits_as_usual(tmp_path):
    out = tmp_path / "out"
    assert _launch(tmp_path, tmp_path / "run", out, stop_after=None) == 0
    assert (out / "early.txt").read_text() == "0"


@pytest.mark.parametrize("supervised", [True, False], ids=["under-unbroken-run", "alone"])
def test_a_crash_under_the_supervisor_exits_quickly_and_keeps_what_the_exit_owes(
    tmp_path, supervised
):
    """An uncaught exception under ``unbroken run`` ends the process with the quick exit too (its
    relaunch, or torchrun's agent, waits for it), after the traceback, keeping what the exit owes;
    alone, a crash exits as Python does."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "quick.py"
    script.write_text(_SCRIPT)
    cmd = [sys.executable, str(script), str(out), str(tmp_path / "run"), str(STEPS), "6"]
    if supervised:
        cmd = [sys.executable, "-m", "unbroken", "run", "--max-retries", "0", "--", *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: crash at step 6" in proc.stderr, proc.stderr[-3000:]
    frozen = int((out / "early.txt").read_text())
    assert (frozen > 0) == supervised, f"gc.get_freeze_count() at the early handler: {frozen}"
    assert (out / "late.txt").read_text() == "ran"
    steps = [f"step {s}" for s in range(1, 7)]
    assert (out / "journal.txt").read_text().splitlines() == steps, (
        "the unclosed file lost its tail"
    )
    assert (out / "c-journal.txt").read_text().splitlines() == steps, "C's stdio buffer lost"
