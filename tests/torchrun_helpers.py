"""Shared by the torchrun tests: real torchrun from the venv, 2 gloo ranks on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.dist_launch import free_port
from tests.golden import ROOT

SCRIPT = ROOT / "tests" / "scripts" / "dist_train.py"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
HANG = 120  # seconds: only a hang ever gets near this (no timing is asserted)


def env(**extra: str) -> dict[str, str]:
    # The suite may itself run under SLURM or a supervisor: the processes must not see that.
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UNBROKEN_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(k, None)
    return {**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def torchrun(*args: str, script: Path = SCRIPT) -> list[str]:
    port = str(free_port())
    launcher = [TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    return [*launcher, "--master_port", port, str(script), *args]


def supervised(*opts: str) -> list[str]:
    return [sys.executable, "-m", "unbroken", "run", *opts, "--"]


def start(cmd: list[str], environ: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd,
        env=environ or env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # no terminal: Ctrl-C handling must not kick in
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=HANG)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"hung past {HANG}s:\n{out[-4000:]}") from None
    return proc.returncode, out


STEPS = ["--steps", "10", "--save-every", "3"]  # the run every golden test here compares
SLOW = [*STEPS, "--step-sleep", "0.25"]  # room to signal or kill mid-run


def run_to_end(run_dir: Path, *args: str) -> None:
    """A 2-rank torchrun launch of the script that must finish (exit 0)."""
    code, out = finish(start(torchrun("--run-dir", str(run_dir), *args)))
    assert code == 0, out[-4000:]


def reference_run(tmp_path_factory: Any) -> Path:
    """The uninterrupted run of STEPS (a module fixture's body)."""
    ref = tmp_path_factory.mktemp("ref") / "run"
    run_to_end(ref, *STEPS)
    return ref


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (what a test started), for cleanup only."""
    for pid in _pids():
        try:
            if os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rank_pids(path: Path) -> list[int]:
    return [int(line.split()[1]) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str]) -> None:
    """Until the metrics log shows ``step`` (the ranks are training)."""
    log = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + HANG
    while True:
        if log.exists():
            steps = [json.loads(x).get("step", 0) for x in log.read_text().splitlines() if x]
            if steps and max(steps) >= step:
                return
        if proc.poll() is not None:
            raise AssertionError(
                f"exited {proc.returncode} before step {step}:\n{proc.communicate()[0][-4000:]}"
            )
        assert time.monotonic() < deadline, f"step {step} never logged"
        time.sleep(0.05)


def wait_gone(pids: list[int]) -> list[int]:
    """Wait (bounded by HANG) for ``pids`` to exit; returns those still alive at the end."""
    deadline = time.monotonic() + HANG
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def report(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data
