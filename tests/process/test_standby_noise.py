"""No noise from the warm standby in a healthy run (issue 46, item 7): the standby is not the
job, so what happens to it before its turn -- a stop signal, a Ctrl-C while it starts, a
script whose set-up cannot run twice -- prints no traceback and no "relaunch" advice; what
the supervisor must know, it says once, in one line.

Real supervisors and processes; a Ctrl-C is the terminal's (SIGINT to the foreground process
group), sent while the standby is held (SIGSTOP) at its very start, so that it lands before
any handler of ours exists however fast the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_launch import free_port
from tests.golden import ROOT, launches
from unbroken.process._tree import alive
from unbroken.supervise import _warm

SCRIPT = ROOT / "tests" / "scripts" / "fixed_port.py"
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UNBROKEN_"))},
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",
}
ENV.pop("WORLD_SIZE", None)
NOISE = ("Traceback", "KeyboardInterrupt", "relaunch to go on")


def _supervise(tmp_path: Path, *options: str, cmd: list[str] | None = None, steps: int = 30):
    run, report = tmp_path / "run", tmp_path / "report.json"
    if cmd is None:
        cmd = [sys.executable, str(SCRIPT)]
    cmd = [*cmd, "--run-dir", str(run), "--port", str(free_port()), "--steps", str(steps)]
    sup = [sys.executable, "-m", "unbroken", "run", "--json", str(report), *options, "--", *cmd]
    proc = subprocess.Popen(
        sup, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, report


def _finish(proc: subprocess.Popen[bytes]) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out.decode(errors="replace")


def test_the_default_standby_never_runs_a_set_up_that_binds_a_fixed_port(tmp_path: Path) -> None:
    """The shallow standby waits before the script: the port is bound once, by the trainer,
    and nothing is said about it."""
    proc, report = _supervise(tmp_path, steps=60)
    text = _finish(proc)
    assert proc.returncode == 0, text[-4000:]
    assert "warm standby: shallow" in text, text
    assert "Address already in use" not in text and "Traceback" not in text, text[-4000:]
    assert text.count("=== fixed_port set-up") == 1, text[-4000:]


def test_a_deep_standby_whose_set_up_fails_before_run_is_explained_once(tmp_path: Path) -> None:
    """``--standby deep`` runs the script up to ``Run()`` beside the trainer: its ``bind`` of
    the trainer's port fails. That is said by the supervisor in one line -- the exception, the
    script's line -- not as the standby's traceback, and a shallow standby is kept instead
    (before: an EADDRINUSE traceback from every deep standby, in the middle of a healthy run)."""
    proc, report = _supervise(tmp_path, "--standby", "deep", steps=60)
    text = _finish(proc)
    assert proc.returncode == 0, text[-4000:]
    for noise in NOISE:
        assert noise not in text, (noise, text[-4000:])
    line = next(i for i, t in enumerate(SCRIPT.read_text().splitlines(), 1) if "sock.bind(" in t)
    said = [t for t in text.splitlines() if "Address already in use" in t]
    assert len(said) == 1 and said[0].startswith("unbroken run: the deep standby"), text[-4000:]
    assert f"fixed_port.py:{line}" in said[0] and "OSError" in said[0], said
    assert "a shallow standby instead" in said[0], said
    assert json.loads(report.read_text())["exit_code"] == 0


def test_a_bash_wrapper_gets_no_standby(tmp_path: Path) -> None:
    """docs/supervise.md: a shell script gets no standby (nothing to wait before). A bash
    wrapper around the script: said at start-up, and no second copy of the script ever runs
    (its port bound once, its set-up line printed once)."""
    wrapper = tmp_path / "train.sh"
    wrapper.write_text(f'#!/bin/bash\nexec "{sys.executable}" "{SCRIPT}" "$@"\n')
    wrapper.chmod(0o755)
    proc, _ = _supervise(tmp_path, cmd=["bash", str(wrapper)], steps=60)
    text = _finish(proc)
    assert proc.returncode == 0, text[-4000:]
    assert "no warm standby: CMD is not `python SCRIPT" in text, text
    assert "Address already in use" not in text and "Traceback" not in text, text[-4000:]
    assert text.count("=== fixed_port set-up") == 1, text[-4000:]


def _new_standby(sup: subprocess.Popen[bytes], seen: set[int]) -> int | None:
    """A standby just exec'd (its command line is the shallow one's), not one of ``seen``."""
    for pid in launches(sup.pid):
        if pid in seen:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"unbroken.supervise._warm" in f.read():
                    return pid
        except OSError:
            pass
    return None


def _sigint_set(pid: int) -> bool:
    """Whether ``pid``'s SIGINT is no longer at its default action: caught or ignored."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = dict(line.split(":", 1) for line in f if line.startswith(("SigCgt", "SigIgn")))
    except OSError:
        return False
    return any(int(m, 16) >> (signal.SIGINT - 1) & 1 for m in masks.values())


def test_ctrl_c_while_the_standby_starts_prints_no_traceback(tmp_path: Path) -> None:
    """The terminal's Ctrl-C reaches its whole foreground process group: the trainer, which
    saves and exits 75, and the standby -- here held at its very start, as soon as its SIGINT
    is no longer at the default action (the interpreter starting, nothing imported), where
    Python's own handler would raise a ``KeyboardInterrupt`` and print its traceback. The
    standby is started with SIGINT ignored until unbroken's handlers exist: nothing is printed,
    and the job stops with 75."""
    proc, report = _supervise(tmp_path, steps=400)
    held = None
    try:
        deadline = time.monotonic() + 240
        while held is None or not _sigint_set(held):
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            held = held or _new_standby(proc, set())
            time.sleep(0.0005)
        os.kill(held, signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends
        # Continued at once, so the SIGINT pending in it is handled now: the supervisor, on the
        # same Ctrl-C, ends its standby soon after (a SIGKILL, which takes a stopped process
        # too), and a standby it ended first would have handled nothing.
        _resume(held)
    except BaseException:
        if held is not None:
            _resume(held)
        raise
    text = _finish(proc)
    assert proc.returncode == 75, text[-4000:]
    for noise in NOISE:
        assert noise not in text, (noise, text[-4000:])
    assert not alive(held)


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already ended by its supervisor
        os.kill(pid, signal.SIGCONT)


def _waiting_standby(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """A shallow standby as the supervisor starts one (its pipe, the next attempt's
    environment), waiting; returns it and the write end of its pipe."""
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the standby ran the script')\n")
    cmd = _warm.command([sys.executable, str(script)])
    assert cmd is not None
    r, w = os.pipe()
    env = {**ENV, "UNBROKEN_SUPERVISED": "1", "UNBROKEN_STANDBY": str(r)}
    env["UNBROKEN_STOP_DIR"] = str(tmp_path / "stops")
    proc = subprocess.Popen(
        cmd, env=env, pass_fds=(r,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    os.close(r)
    deadline = time.monotonic() + 180
    while True:
        try:
            with open(f"/proc/{proc.pid}/comm") as f:
                if f.read().strip() == "standby-waiting":
                    return proc, w
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_to_a_waiting_standby_ends_it_quietly(tmp_path: Path, sig: int) -> None:
    """A scheduler's SIGTERM to every process of a job whose trainer just finished (exit 0),
    or a Ctrl-C, reaches the waiting standby too: it exits 75 with its stop marker, as
    before, but says nothing -- "exit 75, relaunch to go on" from a process that is not the
    job, in a job that exits 0, was wrong advice."""
    proc, w = _waiting_standby(tmp_path)
    try:
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(w)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    assert err == "" and out == "", err
    markers = os.listdir(tmp_path / "stops")
    assert markers == ["rank-00000.json"], markers
