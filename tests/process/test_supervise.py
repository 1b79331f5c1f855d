"""``unbroken run``: relaunch, crash retries, signal forwarding, SLURM requeue, the report.

Every test runs the real CLI in a subprocess with tiny child scripts, so what is checked is
what a user sees: exit codes, the child's environment, and the calls to ``scontrol``.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest

# Exits with the next code of a comma list, one per attempt ("kill" = SIGKILL itself), and
# logs what it saw so the tests can check attempt numbering and timing.
CHILD = """\
import json, os, signal, sys, time
state, codes = sys.argv[1], sys.argv[2].split(",")
log = os.path.join(state, "attempts.jsonl")
n = sum(1 for _ in open(log)) if os.path.exists(log) else 0
code = codes[min(n, len(codes) - 1)]
with open(log, "a") as f:
    f.write(json.dumps({"attempt": os.environ.get("UNBROKEN_ATTEMPT"),
                        "supervised": os.environ.get("UNBROKEN_SUPERVISED"),
                        "t": time.time()}) + "\\n")
if code == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(code))
"""

# Trains "forever" until a stop signal, then saves and exits 75 like the unbroken loop does.
# It waits a little after the first signal so that a duplicate copy would be counted too.
SLEEPER = """\
import os, signal, sys, time
state = sys.argv[1]
got = []
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(s, lambda signum, frame: got.append(signal.Signals(signum).name))
with open(os.path.join(state, "attempts.log"), "a") as f:
    f.write(os.environ["UNBROKEN_ATTEMPT"] + "\\n")
open(os.path.join(state, "ready"), "w").close()
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.01)
if not got:
    sys.exit(0)  # nobody asked it to stop
time.sleep(0.3)
with open(os.path.join(state, "saved"), "w") as f:
    f.write(",".join(got))
sys.exit(75)
"""

FAKE_SCONTROL = """#!/bin/sh
echo "$@" >> "$SCONTROL_LOG"
exit "${SCONTROL_RC:-0}"
"""


def clean_env(**extra: str) -> dict[str, str]:
    # The suite itself may run inside a SLURM job; the supervisor must not see that one.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UNBROKEN_"))}
    env.update(extra)
    return env


def script(tmp_path: Path, name: str, text: str) -> list[str]:
    path = tmp_path / name
    path.write_text(text)
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return [sys.executable, str(path), str(state)]


def supervise(
    tmp_path: Path, *opts: str, codes: str = "0", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "unbroken", "run", *opts, "--"]
    cmd += [*script(tmp_path, "child.py", CHILD), codes]
    return subprocess.run(
        cmd,
        env=env or clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        start_new_session=True,  # no controlling terminal: Ctrl-C dedup must not kick in
    )


def attempts(tmp_path: Path) -> list[dict[str, Any]]:
    log = tmp_path / "state" / "attempts.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()]


def report(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def fake_scontrol(tmp_path: Path, rc: int = 0, **slurm: str) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "scontrol"
    fake.write_text(FAKE_SCONTROL)
    fake.chmod(0o755)
    return clean_env(
        PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        SCONTROL_RC=str(rc),
        **slurm,
    )


def scontrol_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


# -- relaunch and crash policy ----------------------------------------------------------


def test_relaunches_after_resumable_until_success_and_numbers_attempts(tmp_path: Path) -> None:
    r = supervise(tmp_path, codes="75,75,0")
    assert r.returncode == 0, r.stderr
    seen = attempts(tmp_path)
    assert [a["attempt"] for a in seen] == ["1", "2", "3"]
    assert {a["supervised"] for a in seen} == {"1"}
    assert "attempt 3: " in r.stderr and "-> done" in r.stderr
    assert "finished; exit 0 after 3 attempt(s), 2 restart(s)" in r.stderr


def test_crashes_are_retried_with_doubling_backoff(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = supervise(tmp_path, "--backoff", "0.2", "--json", str(out), codes="3,kill,0")
    assert r.returncode == 0, r.stderr
    rep = report(out)
    assert [a["status"] for a in rep["attempts"]] == ["crash", "crash", "ok"]
    assert [a["backoff_s"] for a in rep["attempts"]] == [0.2, 0.4, 0.0]
    assert rep["attempts"][1]["signal"] == "SIGKILL"
    t = [a["t"] for a in attempts(tmp_path)]
    assert t[1] - t[0] >= 0.2 and t[2] - t[1] >= 0.4  # the waits really happened
    assert "retry 2/3 in 0.4s" in r.stderr


def test_backoff_is_capped_by_max_backoff(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    opts = ("--backoff", "0.01", "--max-backoff", "0.03", "--max-retries", "5")
    r = supervise(tmp_path, *opts, "--json", str(out), codes="3,3,3,3,0")
    assert r.returncode == 0, r.stderr
    assert [a["backoff_s"] for a in report(out)["attempts"]] == [0.01, 0.02, 0.03, 0.03, 0.0]


def test_exhausted_crash_retries_exit_with_the_child_code(tmp_path: Path) -> None:
    r = supervise(tmp_path, "--backoff", "0.01", "--max-retries", "2", codes="7")
    assert r.returncode == 7
    assert len(attempts(tmp_path)) == 3  # the first try and two retries
    assert "gave up after 3 crashes in a row without progress (--max-retries 2); exit 7" in r.stderr


def test_four_kills_without_progress_give_up_loudly_with_the_default_retries(
    tmp_path: Path,
) -> None:
    """The default --max-retries 3: the first try and three retries, each SIGKILLed before it
    made progress, then a clear message and exit 1 (death by a signal has no code of its own)."""
    out = tmp_path / "r.json"
    r = supervise(tmp_path, "--backoff", "0.01", "--json", str(out), codes="kill")
    assert r.returncode == 1
    rep = report(out)
    assert [a["status"] for a in rep["attempts"]] == ["crash"] * 4
    assert [a["signal"] for a in rep["attempts"]] == ["SIGKILL"] * 4
    assert "gave up after 4 crashes in a row without progress (--max-retries 3)" in r.stderr


def test_exhausted_after_signal_death_exits_1(tmp_path: Path) -> None:
    r = supervise(tmp_path, "--max-retries", "0", codes="kill")
    assert r.returncode == 1
    assert len(attempts(tmp_path)) == 1
    assert "killed by SIGKILL" in r.stderr


def test_resumable_exit_resets_the_crash_run(tmp_path: Path) -> None:
    r = supervise(tmp_path, "--backoff", "0.01", "--max-retries", "1", codes="3,75,3,75,3,0")
    assert r.returncode == 0, r.stderr
    assert len(attempts(tmp_path)) == 6


def test_long_attempt_resets_the_crash_run(tmp_path: Path) -> None:
    # --reset-after 0: every crash ran "long", so no run of crashes ever exceeds one.
    opts = ("--backoff", "0.01", "--max-retries", "1", "--reset-after", "0")
    assert supervise(tmp_path, *opts, codes="3,3,3,0").returncode == 0
    # ...while without the reset the second crash in a row is the last.
    other = tmp_path / "other"
    other.mkdir()
    r = supervise(other, "--backoff", "0.01", "--max-retries", "1", codes="3,3,3,0")
    assert r.returncode == 3 and len(attempts(other)) == 2


def test_max_restarts_bounds_resumable_relaunches(tmp_path: Path) -> None:
    r = supervise(tmp_path, "--max-restarts", "2", codes="75,75,75,0")
    assert r.returncode == 75
    assert len(attempts(tmp_path)) == 3
    assert "restart limit reached (--max-restarts 2)" in r.stderr


def test_json_report_contents(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    r = supervise(tmp_path, "--quiet", "--backoff", "0.01", "--json", str(out), codes="75,4,0")
    assert r.returncode == 0
    rep = report(out)
    assert rep["exit_code"] == 0 and rep["outcome"] == "finished" and rep["restarts"] == 2
    assert rep["command"][-1] == "75,4,0" and rep["command"][0] == sys.executable
    assert rep["stop_signal"] is None and rep["slurm_job"] is None and rep["requeued"] is False
    got = [(a["attempt"], a["returncode"], a["status"], a["action"]) for a in rep["attempts"]]
    assert got == [(1, 75, "resumable", "relaunch"), (2, 4, "crash", "retry"), (3, 0, "ok", "done")]
    assert all(a["duration_s"] >= 0 and a["started"] > 0 for a in rep["attempts"])
    # --quiet: the summary only, no per-attempt lines.
    assert "attempt 1:" not in r.stderr and "finished; exit 0 after 3 attempt(s)" in r.stderr


def test_missing_command_is_a_usage_error_and_unknown_program_fails(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "unbroken", "run"]
    r = subprocess.run([*base, "--"], capture_output=True, text=True, env=clean_env())
    assert r.returncode == 2 and "no command given" in r.stderr
    missing = str(tmp_path / "no-such-program")
    r = subprocess.run([*base, "--", missing], capture_output=True, text=True, env=clean_env())
    assert r.returncode == 1 and "could not start" in r.stderr


# -- signals ------------------------------------------------------------------------------


def start_sleeper(tmp_path: Path, *opts: str, env: dict[str, str] | None = None) -> Any:
    cmd = [sys.executable, "-m", "unbroken", "run", *opts, "--"]
    cmd += script(tmp_path, "sleeper.py", SLEEPER)
    proc = subprocess.Popen(
        cmd,
        env=env or clean_env(),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready = tmp_path / "state" / "ready"
    deadline = time.monotonic() + 60  # ends as soon as it is ready: slack for a loaded machine
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "child never started"
        time.sleep(0.01)
    return proc


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP"])
def test_stop_signal_is_forwarded_and_not_relaunched(tmp_path: Path, sig: str) -> None:
    out = tmp_path / "r.json"
    proc = start_sleeper(tmp_path, "--json", str(out))
    proc.send_signal(signal.Signals[sig])
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 75, err
    state = tmp_path / "state"
    assert (state / "saved").read_text() == sig  # delivered exactly once
    assert (state / "attempts.log").read_text().split() == ["1"]
    rep = report(out)
    assert rep["stop_signal"] == sig and rep["attempts"][-1]["action"] == "stop"
    assert rep["attempts"][-1]["signals"] == [f"{sig}: forwarded"]


def test_stop_during_backoff_ends_without_relaunch(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--backoff", "20", "--json", str(out), "--"]
        + [*script(tmp_path, "child.py", CHILD), "5,0"],
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # The attempt line is printed right before the backoff starts (a fixed pause was not
    # enough on a loaded machine, with the supervisor importing the store in the background).
    assert proc.stderr is not None
    first = proc.stderr.readline()
    while first and "attempt 1:" not in first:  # (what it said at start-up)
        first = proc.stderr.readline()
    assert "retry 1/3 in 20s" in first, first
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 15  # not the 20 s backoff
    assert proc.returncode == 5, err  # the crash, not "resumable"
    assert len(attempts(tmp_path)) == 1 and "during backoff" in err
    assert report(out)["attempts"][0]["signals"] == ["SIGTERM: no child running"]


def _take_terminal() -> None:
    # Runs in the supervisor before exec: own session, with the pty as controlling terminal.
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_ctrl_c_on_a_terminal_reaches_the_child_once(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken", "run", "--json", str(out), "--"]
            + script(tmp_path, "sleeper.py", SLEEPER),
            env=clean_env(),
            stdin=slave,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_take_terminal,
        )
        ready = tmp_path / "state" / "ready"
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.write(master, b"\x03")  # the terminal sends SIGINT to child and supervisor alike
        _, err = proc.communicate(timeout=15)
    finally:
        os.close(master)
        os.close(slave)
    assert proc.returncode == 75, err
    # The supervisor saw the Ctrl-C too but knew the terminal had delivered it already. (The
    # child's own count alone cannot always tell: the kernel merges two quick SIGINTs.)
    got = report(out)["attempts"][0]["signals"]
    assert got == ["SIGINT: sent by the terminal, not forwarded"]
    assert (tmp_path / "state" / "saved").read_text() == "SIGINT"  # not "SIGINT,SIGINT"


# -- SLURM ------------------------------------------------------------------------------------


def test_slurm_resumable_exit_requeues_the_job(tmp_path: Path) -> None:
    env = fake_scontrol(tmp_path, SLURM_JOB_ID="1234")
    out = tmp_path / "r.json"
    r = supervise(tmp_path, "--json", str(out), codes="75,0", env=env)
    assert r.returncode == 75, r.stderr
    assert scontrol_calls(tmp_path) == ["requeue 1234"]
    assert len(attempts(tmp_path)) == 1  # requeued, not relaunched in place
    rep = report(out)
    assert rep["requeued"] is True and rep["slurm_job"] == "1234"
    assert "requeued SLURM job 1234" in r.stderr


def test_slurm_array_job_is_requeued_by_array_id(tmp_path: Path) -> None:
    env = fake_scontrol(
        tmp_path, SLURM_JOB_ID="1240", SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="5"
    )
    r = supervise(tmp_path, codes="75,0", env=env)
    assert r.returncode == 75, r.stderr
    assert scontrol_calls(tmp_path) == ["requeue 77_5"]


def test_slurm_stop_signal_requeues(tmp_path: Path) -> None:
    env = fake_scontrol(tmp_path, SLURM_JOB_ID="1234")
    proc = start_sleeper(tmp_path, env=env)
    proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@120` sends
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 75, err
    assert scontrol_calls(tmp_path) == ["requeue 1234"]


def test_slurm_crash_is_retried_in_place(tmp_path: Path) -> None:
    env = fake_scontrol(tmp_path, SLURM_JOB_ID="1234")
    r = supervise(tmp_path, "--backoff", "0.01", codes="3,0", env=env)
    assert r.returncode == 0, r.stderr
    assert scontrol_calls(tmp_path) == [] and len(attempts(tmp_path)) == 2


def test_failing_scontrol_falls_back_to_relaunch(tmp_path: Path) -> None:
    env = fake_scontrol(tmp_path, rc=1, SLURM_JOB_ID="1234")
    r = supervise(tmp_path, codes="75,75,0", env=env)
    assert r.returncode == 0, r.stderr
    assert scontrol_calls(tmp_path) == ["requeue 1234"]  # tried once, then in place
    assert len(attempts(tmp_path)) == 3
    assert "scontrol requeue 1234 failed (exit 1" in r.stderr


def test_missing_scontrol_falls_back_to_relaunch(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = supervise(tmp_path, codes="75,0", env=clean_env(PATH=str(empty), SLURM_JOB_ID="9"))
    assert r.returncode == 0, r.stderr
    assert len(attempts(tmp_path)) == 2 and "scontrol requeue 9 failed" in r.stderr


def test_no_requeue_relaunches_in_place_under_slurm(tmp_path: Path) -> None:
    env = fake_scontrol(tmp_path, SLURM_JOB_ID="1234")
    r = supervise(tmp_path, "--no-requeue", codes="75,0", env=env)
    assert r.returncode == 0, r.stderr
    assert scontrol_calls(tmp_path) == [] and len(attempts(tmp_path)) == 2
