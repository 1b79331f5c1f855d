"""The warm standby of a single-node torchrun job (issue 33, multi-rank): ``unbroken run --
torchrun --standalone ...`` keeps a second torchrun whose workers wait, torch and unbroken
imported, before the script; when a rank of the job dies the whole standby job takes over.

Real torchrun agents and workers (gloo on CPU), real FIFOs, real signals. Before each kill the
trainer's workers are frozen (SIGSTOP) until both standby workers wait, so every recovery goes
through the standby however loaded the machine (a handshake, no timing).
"""

from __future__ import annotations

import argparse
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

from tests.golden import ROOT, assert_identical, attempt_of, launches, logged_steps, resume_steps
from unbroken.process._tree import alive, descendants
from unbroken.supervise import _warm
from unbroken.supervise._standby import GO, off_reason

SCRIPT = ROOT / "tests" / "scripts" / "toy_dist.py"
STEPS = 24
ARGS = ["--steps", str(STEPS), "--save-every", "1000"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
PROMOTED = r"from the warm standby \(pid (\d+)\)"
WAITING = "standby-waiting"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_the_option_lists_are_torchruns_own() -> None:
    """The rewrite parses torchrun's options by name (the supervisor does not import torch):
    the names that take no value and those that take one are exactly torchrun's."""
    from torch.distributed.run import get_args_parser

    flags, valued = set(), set()
    for action in get_args_parser()._actions:
        if action.option_strings and "--help" not in action.option_strings:
            (flags if action.nargs == 0 else valued).update(action.option_strings)
    assert flags == _warm.TORCHRUN_FLAGS
    assert valued == _warm.TORCHRUN_VALUED


def test_which_torchrun_commands_get_a_standby() -> None:
    tail = ["-u", "-c", _warm.BOOT]
    py = sys.executable
    cmd = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert _warm.torchrun_command([*cmd, "t.py", "--lr", "1"], {}) == [
        *cmd[:3],
        "--standalone",
        "--nproc-per-node=2",
        "--no-python",
        _which("python"),
        *tail,
        "--",
        "t.py",
        "--lr",
        "1",
    ]
    torchrun = str(Path(py).parent / "torchrun")  # pip's script: its shebang names the python
    got = _warm.torchrun_command([torchrun, "--nproc_per_node", "2", "--standalone", "-m", "p"], {})
    assert got == [
        torchrun,
        "--nproc_per_node",
        "2",
        "--standalone",
        "--no-python",
        py,
        *tail,
        "-m",
        "p",
    ]
    got = _warm.torchrun_command(["torchrun", "--standalone", "-r3", "--", "t.py"], {})
    assert got is not None and got[-3:] == [_warm.BOOT, "--", "t.py"], got
    exe = {"PYTHON_EXEC": "/opt/py/bin/python3"}  # torchrun runs its workers with this one
    assert (
        _warm.torchrun_command(["torchrun", "--standalone", "t.py"], exe)[3] == exe["PYTHON_EXEC"]
    )  # type: ignore[index]
    for bad, env in (
        (["torchrun", "--nproc_per_node", "2", "t.py"], {}),  # a shared rendezvous
        (["torchrun", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "t.py"], {}),
        (["torchrun", "--standalone", "--no-python", "bash", "t.sh"], {}),
        (["torchrun", "--standalone", "--run-path", "t.py"], {}),
        (["torchrun", "--standalone", "--nproc", "2", "t.py"], {}),  # abbreviated: refused
        (["torchrun", "--standalone", "--nproc_per_node"], {}),
        (["torchrun", "--standalone"], {}),
        (["torchrun", "--standalone", "t.py"], {"PET_NO_PYTHON": "1"}),
        (["accelerate", "launch", "t.py"], {}),
        (["python", "t.py"], {}),
    ):
        assert _warm.torchrun_command(bad, env) is None, bad
    assert _warm.torchrun_command(["torchrun", "t.py"], {"PET_STANDALONE": "1"}) is not None

    args = argparse.Namespace(no_standby=False, standby=None)
    standalone = ["torchrun", "--standalone", "t.py"]
    assert off_reason(args, standalone, {}, True) is None
    assert "without --standalone" in str(off_reason(args, ["torchrun", "t.py"], {}, True))
    assert str(off_reason(args, ["accelerate", "launch", "t.py"], {}, True)).startswith(
        "CMD is a launcher"
    )
    for deep in ("deep", "run"):  # (run: the deep standby's old name)
        assert "the default waits before the script" in str(
            off_reason(argparse.Namespace(standby=deep), standalone, {}, True)
        )
    assert off_reason(argparse.Namespace(standby="imports"), standalone, {}, True) is None
    assert str(off_reason(args, standalone, {}, False)).startswith("no in-memory snapshots")


def _which(name: str) -> str:
    import shutil

    return shutil.which(name) or name


_WAITER = """
import sys
from unbroken.train import _as_standby
_as_standby.wait_for_turn()
print("went", flush=True)
"""


@pytest.mark.parametrize("end", ["go", "late", "eof", "closed", "gone"])
def test_the_wait_on_a_fifo(tmp_path: Path, end: str) -> None:
    """A standby torchrun's worker waits on a FIFO the supervisor holds open: "go" (the bytes
    written while it waits, or before it opened the FIFO: ``late``) lets it on; the writer
    closing (``eof``), a FIFO whose writer had gone before it opened it (``closed``: such a
    FIFO never turns ready) or one removed (``gone``) ends it with 75, touching nothing."""
    fifo = tmp_path / "standby.fifo"
    os.mkfifo(fifo, 0o600)
    w = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    if end == "late":
        os.write(w, b"g" * GO)
    if end == "closed":
        os.close(w)
    if end == "gone":
        os.close(w)
        os.unlink(fifo)
    env = {**ENV, "UNBROKEN_SUPERVISED": "1", "UNBROKEN_STANDBY": str(fifo)}
    env["UNBROKEN_STOP_DIR"] = str(tmp_path / "stops")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WAITER], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        if end in ("go", "eof"):
            deadline = time.monotonic() + 120
            while _comm(proc.pid) != WAITING:
                assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
                time.sleep(0.01)
            if end == "go":
                os.write(w, b"g" * GO)
            os.close(w)
        elif end == "late":
            pass  # the bytes stay while the supervisor holds the FIFO
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if end == "late":
            os.close(w)
    if end in ("go", "late"):
        assert (proc.returncode, out) == (0, "went\n")
    else:
        assert (proc.returncode, out) == (75, ""), (proc.returncode, out)
        assert not (tmp_path / "stops").exists(), "no stop marker: it was not stopped"


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _workers(agent: int) -> dict[int, int]:
    """The torchrun agent's workers: {rank: pid} (those whose environment is readable)."""
    out = {}
    for pid in descendants(agent):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            out[int(env[b"RANK"])] = pid
    return out


def _lift(pids: list[int]) -> None:
    """Out of SCHED_IDLE: on a busy machine an idle-priority standby may wait minutes."""
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass


def _until(cond, what: str, sup: subprocess.Popen[bytes], timeout: float = 240):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sup.poll() is None:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{what}: never happened (supervisor {sup.poll()})")


@pytest.mark.slow
def test_sigkill_of_a_rank_at_drawn_moments_goes_through_the_standby_torchrun(
    tmp_path: Path,
) -> None:
    """Rank 1 of the job SIGKILLed at three drawn steps: torchrun fails the job, the supervisor
    keeps the in-memory snapshot and promotes the standby torchrun, whose workers resume at
    most one step behind; the run ends bitwise equal to an uninterrupted one."""
    ref = tmp_path / "ref"
    subprocess.run(
        [*TORCHRUN, str(SCRIPT), *ARGS, "--run-dir", str(ref)],
        env=ENV,
        check=True,
        capture_output=True,
        timeout=300,
    )
    rng = random.Random(int(os.environ.get("UNBROKEN_TEST_SEED", "33")))
    moments = sorted(rng.sample(range(3, STEPS - 8), 3))  # room for +2 each
    run, report = tmp_path / "run", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "unbroken", "run", "--json", str(report), "--backoff", "0"]
    cmd += ["--", *TORCHRUN, str(SCRIPT), *ARGS, "--run-dir", str(run), "--snapshot-every", "1"]
    cmd += ["--step-sleep", "0.1"]  # (rank 1: 0.2 s) time to freeze a step
    sup = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reached: list[int] = []
    spares: list[int] = []
    held: list[int] = []
    killed: list[int] = []  # the jobs whose rank 1 was killed
    agent = None
    try:
        for at in moments:
            target = max(at, reached[-1] + 2) if reached else at

            def trained(target: int = target, prev: int | None = agent) -> int | None:
                kids = launches(sup.pid)
                steps = logged_steps(run)
                ok = kids and kids[0] != prev and steps and steps[-1] >= target
                return kids[0] if ok and len(_workers(kids[0])) == 2 else None

            agent = _until(trained, f"a job logging step {target}", sup)
            killed.append(agent)
            ranks = _workers(agent)
            held += ranks.values()
            for pid in ranks.values():
                os.kill(pid, signal.SIGSTOP)  # held at this step until the standby waits
            if reached:
                assert agent == spares[-1], "the standby torchrun is the job now"

            def waiting(job: int = agent) -> int | None:
                kids = [p for p in launches(sup.pid) if p != job and alive(p)]
                if not kids or attempt_of(kids[0]) != attempt_of(job) + 1:  # type: ignore[operator]
                    return None
                spare = _workers(kids[0])
                _lift([kids[0], *spare.values()])
                ok = len(spare) == 2 and all(_comm(p) == WAITING for p in spare.values())
                return kids[0] if ok else None

            spares.append(_until(waiting, "the standby's two workers waiting", sup))
            os.kill(ranks[1], signal.SIGKILL)
            os.kill(ranks[0], signal.SIGCONT)  # torchrun ends it as it would any survivor
            _until(lambda a=agent: launches(sup.pid)[:1] != [a], "the job gone", sup)
            reached.append(logged_steps(run)[-1])
        seen: set[int] = set()  # every process of the supervisor's until it ends
        jobs: set[int] = set()  # its torchruns meanwhile
        deadline = time.monotonic() + 400
        while sup.poll() is None and time.monotonic() < deadline:
            jobs.update(launches(sup.pid))
            seen.update(p for k in jobs for p in [k, *descendants(k)])
            time.sleep(0.05)
        out, _ = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        for pid in held:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    text = out.decode(errors="replace")
    assert sup.returncode == 0, text[-5000:]
    resumes = resume_steps(run)
    assert len(resumes) == len(moments), (resumes, reached, text[-3000:])
    for last, resumed in zip(reached, resumes, strict=True):
        assert last - 1 <= resumed <= last, (reached, resumes)  # at most one step redone
    assert_identical(ref, run)
    attempts = json.loads(report.read_text())["attempts"]
    promoted = [int(m) for a in attempts for m in re.findall(PROMOTED, a["note"])]
    assert promoted == spares, attempts  # every recovery was the standby torchrun's
    assert text.count("a second torchrun of CMD") == 1, text[-3000:]
    last_standby = jobs - {*killed, *spares}
    assert len(last_standby) == 1, (jobs, killed, spares)  # beside the last job too
    left = [p for p in seen if alive(p)]
    assert not left, f"left running after supervision: {left}"  # the last standby included
