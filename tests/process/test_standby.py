"""The warm standby (issue 33): under ``unbroken run`` the next attempt is started early and
waits inside its first ``Run()``; when the trainer dies it takes over.

Real supervisors, trainers and signals. The trainer is SIGKILLed from outside at steps drawn
by the test; before each kill it is frozen (SIGSTOP) until the standby waits, so every
recovery goes through a standby however loaded the machine (a handshake, no timing). Each
relaunch must resume at most one step behind the last step the killed trainer logged, and the
run must end bitwise equal to an uninterrupted one (every tensor, every logged step) -- with the
standby, and with ``--no-standby``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import (
    ROOT,
    assert_identical,
    attempt_of,
    launch,
    launches,
    logged_steps,
    resume_steps,
    trainers,
)
from unbroken import read_metrics
from unbroken.process import _shm
from unbroken.process._protocol import ProcessContext
from unbroken.process._tree import alive
from unbroken.supervise import _warm
from unbroken.supervise._standby import UNSNAPPED, Standby, depth, idle_undoable, off_reason

SCRIPT = ROOT / "tests" / "scripts" / "toy_train.py"
STEPS = 30
ARGS = ["--steps", str(STEPS), "--save-every", "1000", "--workers", "0"]
PROMOTED = r"from the warm standby \(pid (\d+)\)"  # the report's note (supervise/_standby.py)
WAITING = "standby-waiting"  # the standby's process name while it waits (train/_as_standby.py)


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _until(cond, what: str, sup: subprocess.Popen[bytes], timeout: float = 180):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sup.poll() is None:
        got = cond()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{what}: never happened (supervisor {sup.poll()})")


def _standby(sup: subprocess.Popen[bytes], trainer: int, waiting: bool = False) -> int | None:
    """The supervisor's standby beside ``trainer`` (``waiting``: only once it waits)."""
    # (its environment is readable once its exec is through)
    kids = [p for p in launches(sup.pid) if p != trainer and alive(p) and attempt_of(p)]
    spare = [p for p in kids if not waiting or _comm(p) == WAITING]
    return spare[0] if spare else None


def _lift(pid: int) -> None:
    """Put a standby that sets up under SCHED_IDLE at the normal priority: on a machine busy
    with other users' work an idle-priority process may not get the CPU for minutes."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass


def _policies(pid: int) -> set[int]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(os.sched_getscheduler(int(tid)))
        except OSError:
            pass
    return out


def _release(held: list[int]) -> None:
    """A failed test must not leave a trainer it held with SIGSTOP behind: stopped, it cannot
    act on the SIGTERM its supervisor's death sends it."""
    for pid in held:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stopped = f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
            if stopped:  # still the process held (a reused pid would not be stopped)
                os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError):
            pass


def _supervise(
    run: Path, report: Path, options: list[str], extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "unbroken", "run", "--json", str(report), "--max-retries", "10"]
    cmd += ["--backoff", "0", *options, "--", sys.executable, str(SCRIPT), *ARGS, *extra]
    cmd += ["--run-dir", str(run), "--step-sleep", "0.05", "--snapshot-every", "1"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


DEPTHS = {"standby": [], "deep": ["--standby", "deep"], "no-standby": ["--no-standby"]}


@pytest.mark.slow
@pytest.mark.parametrize("depth", list(DEPTHS))
def test_sigkill_at_drawn_moments_with_and_without_standby(tmp_path: Path, depth: str) -> None:
    """``standby``, the default (``--standby imports``): the standby waits before the script,
    so what the script does before ``Run()`` happens once per attempt (``--mark``), never in a
    standby that was not promoted. ``deep`` (``--standby deep``): it waits inside ``Run()``,
    having run the script's set-up."""
    standby = depth != "no-standby"
    ref = tmp_path / "ref"
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(ref)]) == 0
    rng = random.Random(int(os.environ.get("UNBROKEN_TEST_SEED", "33")))
    moments = sorted(rng.sample(range(3, STEPS - 2), 5))
    run, report, marks = tmp_path / "run", tmp_path / "report.json", tmp_path / "marks"
    sup = _supervise(run, report, DEPTHS[depth], ("--mark", str(marks)))
    reached: list[int] = []
    spares: list[int] = []
    held: list[int] = []
    child = None
    idle = idle_undoable()
    try:
        for at in moments:
            target = max(at, reached[-1] + 2) if reached else at

            def trained(target: int = target, prev: int | None = child) -> int | None:
                now = trainers(sup.pid)
                steps = logged_steps(run)
                ok = steps and steps[-1] >= target and len(now) == 1 and now[0] != prev
                return now[0] if ok else None

            child = _until(trained, f"a trainer logging step {target}", sup)
            held.append(child)
            os.kill(child, signal.SIGSTOP)  # held at this step until the standby exists
            if standby:
                # Waiting, or still setting up (then it goes on when it reaches Run()): both
                # are promoted; the supervisor puts a standby still on idle time back.
                spare = _until(lambda c=child: _standby(sup, c), "a standby", sup)
                assert attempt_of(spare) == attempt_of(child) + 1  # type: ignore[operator]
                if idle:
                    assert _policies(spare) == {os.SCHED_IDLE}, "set up on idle time only"
                if depth == "standby":  # waiting, it has not run the script
                    _lift(spare)
                    _until(lambda c=child: _standby(sup, c, waiting=True), "it waits", sup)
                    assert str(spare) not in marks.read_text().split(), "ran before its turn"
                spares.append(spare)
                if reached:  # the previous standby, promoted, is the trainer now
                    assert child == spares[-2]
                    assert _policies(child) == {os.SCHED_OTHER}, "every thread back"
            else:
                assert launches(sup.pid) == [child], "no standby with --no-standby"
            os.kill(child, signal.SIGKILL)
            _until(lambda c=child: trainers(sup.pid) != [c], "the trainer gone", sup)
            reached.append(logged_steps(run)[-1])
        out, _ = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        _release(held)
    text = out.decode(errors="replace")
    assert sup.returncode == 0, text[-4000:]
    resumes = resume_steps(run)
    assert len(resumes) == len(moments), (resumes, reached, text[-3000:])
    for last, resumed in zip(reached, resumes, strict=True):
        assert last - 1 <= resumed <= last, (reached, resumes)  # at most one step redone
    assert_identical(ref, run)
    attempts = json.loads(report.read_text())["attempts"]
    promoted = [int(m) for a in attempts for m in re.findall(PROMOTED, a["note"])]
    started = [int(line) for line in marks.read_text().split()]  # pids that ran the script
    if standby:
        assert promoted == spares, attempts  # every recovery was a standby's
        assert text.count("--no-standby turns it off") == 1, text[-3000:]
        assert not alive(spares[-1]), "the last standby is killed when supervision ends"
    else:
        assert not promoted and "--no-standby turns it off" not in text
    assert started[0] == held[0] and set(spares) <= set(started)
    if depth == "standby":
        assert "python with torch and unbroken imported" in text, text[-3000:]
        assert started == [held[0], *spares], "the script ran once per attempt"
    if depth == "deep":
        assert "warm standby: deep (--standby deep)" in text, text[-3000:]
    if depth == "no-standby":
        assert len(started) == len(attempts) == len(moments) + 1


@pytest.mark.slow
def test_stop_while_waiting_and_supervisor_killed(tmp_path: Path) -> None:
    """A stop signal to the waiting standby: it exits 75, touching nothing, and the next crash
    is relaunched afresh (the report says so). Then ``kill -9`` of the supervisor: its new
    standby exits on its own (the pipe's EOF, or the supervisor's death signal), the trainer
    saves and exits 75, and the relaunch ends bitwise equal to an uninterrupted run."""
    ref = tmp_path / "ref"
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(ref)]) == 0
    run, report = tmp_path / "run", tmp_path / "report.json"
    sup = _supervise(run, report, [])
    held: list[int] = []
    try:
        _until(lambda: len(logged_steps(run)) >= 3, "step 3", sup)
        (first,) = trainers(sup.pid)
        assert attempt_of(first) == 1
        held.append(first)
        os.kill(first, signal.SIGSTOP)
        spare = _until(lambda: _standby(sup, first), "a standby", sup)
        _lift(spare)
        _until(lambda: _standby(sup, first, waiting=True), "the standby waiting", sup)
        os.kill(spare, signal.SIGTERM)
        _until(lambda: not alive(spare), "the standby gone", sup)
        killed_at = logged_steps(run)[-1]
        os.kill(first, signal.SIGKILL)

        def second_trains() -> int | None:
            now = trainers(sup.pid)
            ok = now and now[0] != first and logged_steps(run)[-1:] >= [killed_at + 2]
            return now[0] if ok else None

        second = _until(second_trains, "a fresh trainer", sup)
        held.append(second)
        os.kill(second, signal.SIGSTOP)  # held until its standby waits
        assert attempt_of(second) == 2, "the dead standby's attempt, launched afresh"
        third = _until(lambda: _standby(sup, second), "its standby", sup)
        _lift(third)
        _until(lambda: _standby(sup, second, waiting=True), "its standby waiting", sup)
        os.kill(second, signal.SIGCONT)
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (alive(second) or alive(third)):
            time.sleep(0.02)
        assert not alive(third), "the standby outlived its supervisor"
        assert not alive(second), "the trainer outlived it"
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        _release(held)
    attempts_run = read_metrics(str(run), events=True)
    stops = [r for r in attempts_run if r.get("event") == "stop"]
    assert stops, "the trainer saved and stopped when its supervisor died"
    # Only two processes ever opened the run: the first trainer and the fresh one.
    assert len(resume_steps(run)) == 1, resume_steps(run)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "unbroken", "run", "--json", str(report), "--"]
    cmd += [sys.executable, str(SCRIPT), *ARGS, "--run-dir", str(run)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert_identical(ref, run)


def test_standby_marker_and_when_it_is_off() -> None:
    """The marker is a pipe's fd (3 and up); 0 is the user's opt-out. Launchers and one rank of
    several get no standby (a standby rank would join the job's rendezvous while it sets up);
    nor, by default, a command the shallow standby cannot wait before (a shell script): only
    ``--standby deep`` runs it early."""
    assert ProcessContext.read({"UNBROKEN_STANDBY": "7"}).standby_fd == 7
    for value in ("0", "2", "", "x", "-5"):
        assert ProcessContext.read({"UNBROKEN_STANDBY": value}).standby_fd is None
    args = type("A", (), {"no_standby": False, "standby": None})()
    plain = ["python", "train.py"]
    assert off_reason(args, plain, {}, True) is None
    assert str(off_reason(args, plain, {}, False)).startswith("no in-memory snapshots")
    assert off_reason(args, plain, {"UNBROKEN_STANDBY": "0"}, True) == "UNBROKEN_STANDBY=0"
    assert off_reason(args, ["torchrun", "--nproc_per_node", "2", "t.py"], {}, True)
    assert off_reason(args, ["python", "-m", "torch.distributed.run", "t.py"], {}, True)
    assert off_reason(args, plain, {"SLURM_NTASKS": "8"}, True)
    assert off_reason(args, plain, {"WORLD_SIZE": "1"}, True) is None
    assert off_reason(args, plain, {"UNBROKEN_STANDBY": "off"}, True) == "UNBROKEN_STANDBY=off"
    assert off_reason(args, plain, {"UNBROKEN_STANDBY": "imports"}, True) is None
    assert depth(args, {}) == "imports"  # the default: the shallow standby
    for deep in ("deep", "run"):  # (run: its old name)
        assert depth(args, {"UNBROKEN_STANDBY": deep}) == "deep"
    shell = ["bash", "train.sh"]
    assert "--standby deep" in str(off_reason(args, shell, {}, True))
    assert off_reason(args, shell, {"UNBROKEN_STANDBY": "deep"}, True) is None  # runs any CMD
    args.standby = "off"
    assert off_reason(args, plain, {}, True) == "--standby off"
    args.standby = "imports"
    assert depth(args, {"UNBROKEN_STANDBY": "0"}) == "imports"  # the option wins
    args.no_standby = True
    assert off_reason(args, plain, {}, True) == "--no-standby"
    assert depth(args, {}) == "off"


def test_which_commands_the_shallow_standby_can_wait_for() -> None:
    """`--standby imports` rewrites `python [OPTIONS] SCRIPT|-m MODULE ARGS`, keeping every
    option and argument in place; anything else (no script file, a shell, an option it does not
    know) gets None, and the supervisor says why there is no standby."""
    boot = ["-c", _warm.BOOT]
    assert _warm.command(["python", "t.py", "-x", "--steps", "3"]) == [
        "python",
        *boot,
        "--",
        "t.py",
        "-x",
        "--steps",
        "3",
    ]
    assert _warm.command(["/usr/bin/python3.11", "-u", "-W", "ignore", "-Xdev", "t.py"]) == [
        "/usr/bin/python3.11",
        "-u",
        "-W",
        "ignore",
        "-Xdev",
        *boot,
        "--",
        "t.py",
    ]
    assert _warm.command(["python3", "-Bu", "-m", "pkg.train", "-m", "x"]) == [
        "python3",
        "-Bu",
        *boot,
        "-m",
        "pkg.train",
        "-m",
        "x",
    ]
    for cmd in (
        [],
        ["python"],
        ["python", "-c", "print(1)"],
        ["python", "-"],
        ["python", "-i", "t.py"],
        ["python", "-V"],
        ["python", "-m"],
        ["python", "-W"],
        ["python", "--check-hash-based-pycs", "always", "t.py"],
        ["bash", "train.sh"],
        ["torchrun", "t.py"],
        ["pythonista", "t.py"],
    ):
        assert _warm.command(cmd) is None, cmd


_WAITER = """
import os, sys, time
from unbroken.process import _signals
from unbroken.train import _as_standby
t0 = time.time()
_as_standby.wait_for_turn()
_as_standby.wait_for_turn()  # a second Run(): no wait
name = open("/proc/self/comm").read().strip()
print(_signals.process_start() >= t0, "UNBROKEN_STANDBY" in os.environ, name, flush=True)
"""


@pytest.mark.parametrize("end", ["go", "eof", "stop"])
def test_the_wait_itself(tmp_path: Path, end: str) -> None:
    """The standby's side alone: "go" lets ``Run()`` on (its time budget counted from then,
    its name and environment as a trainer's, a second ``Run()`` does not wait); EOF (the
    supervisor gone) ends it with 75 and no stop marker; a stop signal while it waits ends it
    with 75 and a stop marker, as any process stopped before training."""
    r, w = os.pipe()
    stops = tmp_path / "stops"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UNBROKEN_SUPERVISED": "1"}
    env.update({"UNBROKEN_STANDBY": str(r), "UNBROKEN_STOP_DIR": str(stops)})
    proc = subprocess.Popen(
        [sys.executable, "-c", _WAITER], env=env, pass_fds=(r,), stdout=subprocess.PIPE, text=True
    )
    os.close(r)
    try:
        deadline = time.monotonic() + 120
        while _comm(proc.pid) != WAITING:
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.01)
        if end == "go":
            os.write(w, b"g")
        if end == "stop":
            os.kill(proc.pid, signal.SIGTERM)  # the pipe stays open: no EOF to see
        else:
            os.close(w)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if end == "stop":
            os.close(w)
    if end == "go":
        assert proc.returncode == 0 and out.split() == ["True", "False", "python"], out
    else:
        assert proc.returncode == 75 and out == "", (proc.returncode, out)
        markers = sorted(os.listdir(stops)) if stops.exists() else []
        assert markers == (["rank-00000.json"] if end == "stop" else []), markers


def test_a_run_opening_is_seen_whatever_the_file_clock(tmp_path: Path) -> None:
    """The supervisor starts the next standby once the trainer's ``Run`` rewrote the channel:
    seen by the channel moving past its mark, not by comparing its time with the supervisor's
    clock. File times come from the kernel's coarse clock, up to a tick behind
    ``time.time_ns()``: a standby promoted at once wrote the channel "before" the attempt began
    (0.4 ms, seen), and no standby came after it. Here the lag is exaggerated past UNSNAPPED."""
    area = _shm.SupervisorArea.create(str(tmp_path))
    args = type("A", (), {"no_standby": False, "quiet": True})()
    sb = Standby(args, ["python", "t.py"], str(tmp_path / "stops"), area, lambda _: None)
    previous = time.time_ns() - 120 * 10**9
    assert _shm.tell_run_dir(area.path, str(tmp_path / "run"))  # the previous attempt's Run
    os.utime(area.channel, ns=(previous, previous))
    mark = sb.mark()
    assert not sb._run_opened(mark)
    assert _shm.tell_run_dir(area.path, str(tmp_path / "run"))  # this attempt's Run opens
    behind = time.time_ns() - int((UNSNAPPED + 1) * 10**9)  # behind any clock, past the mark
    os.utime(area.channel, ns=(behind, behind))
    assert sb._run_opened(mark)


# A promoted standby whose one process is still SCHED_IDLE: it forks a child that is.
_LEFT_IDLE = """
import os, subprocess, sys
os.read(int(os.environ["UNBROKEN_STANDBY"]), 1)  # the promotion
child = (
    "import os, sys, time; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0));"
    "time.sleep(1.5); open(sys.argv[1], 'w').write(str(os.sched_getscheduler(0)))"
)
subprocess.run([sys.executable, "-c", child, sys.argv[1]], check=True)
"""


@pytest.mark.skipif(not idle_undoable(), reason="SCHED_IDLE cannot be undone here (not root)")
def test_a_promoted_standby_is_kept_out_of_sched_idle_until_it_trains(tmp_path: Path) -> None:
    """The supervisor lifts a promoted standby out of SCHED_IDLE at the promotion, and then on
    every look until its ``Run`` opened and trained: a process of it that the first lift missed
    (one forked while the supervisor read the process table, a thread started meanwhile) would
    otherwise import torch on idle time -- on a busy machine, minutes (seen on CI: a standby
    torchrun's rank never got through its imports and the job hung for 400 s). Here the
    missed process is one that enters SCHED_IDLE after the promotion; it reports its policy
    1.5 s later."""
    area = _shm.SupervisorArea.create(str(tmp_path))
    stops = tmp_path / "stops"
    stops.mkdir(mode=0o700)
    policy = tmp_path / "policy"
    args = type("A", (), {"no_standby": False, "quiet": True, "standby": "deep"})()
    cmd = [sys.executable, "-c", _LEFT_IDLE, str(policy)]
    sb = Standby(args, cmd, str(stops), area, lambda _: None)
    assert sb.off is None, sb.off
    try:
        sb._start(2)
        promoted, note = sb.take(2)
        assert promoted is not None, note
        assert sb.wait(promoted, 2, sb.mark(), lambda: False) == 0
    finally:
        sb.close()
    assert policy.read_text() == str(os.SCHED_OTHER), "left on idle time after its promotion"
