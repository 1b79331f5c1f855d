"""Safe by default under ``unbroken run``: nothing of the user's script runs except in the one
process that trains, a bug is not retried forever, and every decision is said at start-up.

The golden tests run ``tests/scripts/setup_effects.py``, whose set-up before ``Run()`` has the
side effects real scripts have (a banner, a log file opened with ``filemode="w"``, an
unconditional download then ``np.memmap`` reads, a config file, a set-up counter), under
``unbroken run`` with the default options: without a crash the set-up runs once and every file
is intact; with ``kill -9`` of the trainer at drawn steps (each time with the standby waiting)
it runs once per attempt, the files are intact and the run ends bitwise equal to an
uninterrupted one.
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
    is_persister,
    launch,
    logged_steps,
    resume_steps,
    trainers,
)
from tests.process.test_standby import _lift, _release, _standby, _until
from unbroken.process._tree import alive, children
from unbroken.supervise import _warm

SCRIPT = ROOT / "tests" / "scripts" / "setup_effects.py"
STEPS = 30
ARGS = ["--steps", str(STEPS), "--omp", "1"]
PROMOTED = r"from the warm standby \(pid (\d+)\)"
STEP_LINE = re.compile(r"^train step (\d+) loss -?\d+\.\d+(e[-+]\d+)?$")
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UNBROKEN_"))},
    "PYTHONPATH": str(ROOT),
}
for _var in ("WORLD_SIZE", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    ENV.pop(_var, None)


def _supervise(
    run: Path, report: Path, *options: str, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "unbroken", "run", "--json", str(report), *options, "--"]
    cmd += [sys.executable, str(SCRIPT), *ARGS, "--run-dir", str(run), *extra]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _oom(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


def _persister(sup: int) -> int | None:
    found = [p for p in children(sup) if is_persister(p)]
    return found[0] if found else None


def _setups(run: Path) -> list[tuple[int, str, str]]:
    """(pid, attempt, torch's thread count) of every process that ran the set-up."""
    lines = (run / "setup.txt").read_text().splitlines()
    return [(int(p), a, t) for p, a, t in (line.split() for line in lines)]


def _files_intact(run: Path, first: int) -> None:
    """The log has every step from ``first`` to the end, one line each, no hole (no NUL bytes:
    a second process truncating it under the trainer leaves them); the data and the config are
    whole."""
    raw = (run / "train.log").read_bytes()
    assert b"\0" not in raw, "the trainer's log was truncated under it"
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, raw.decode().splitlines()) if m]
    assert steps == list(range(first, STEPS + 1)), steps
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import setup_effects
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert (run / "data.bin").read_bytes() == setup_effects.data_bytes()
    config = json.loads((run / "config.json").read_text())
    assert config == {"steps": STEPS, "rows": 2048, "features": 8}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("setup-ref") / "run"
    assert launch(SCRIPT, [*ARGS, "--run-dir", str(run)]) == 0
    return run


@pytest.mark.slow
def test_no_crash_the_set_up_runs_once_and_every_file_is_intact(
    tmp_path: Path, reference: Path
) -> None:
    """The trainer is held (SIGSTOP) at step 5 until its standby waits, so the standby had
    every chance to run what it would run; then the run goes on to the end."""
    run, report = tmp_path / "run", tmp_path / "report.json"
    sup = _supervise(run, report, extra=("--step-sleep", "0.05"))
    held: list[int] = []
    try:
        _until(lambda: len(logged_steps(run)) >= 5, "step 5", sup)
        (child,) = trainers(sup.pid)
        held.append(child)
        os.kill(child, signal.SIGSTOP)
        spare = _until(lambda: _standby(sup, child), "a standby", sup)
        _lift(spare)
        _until(lambda: _standby(sup, child, waiting=True), "the standby waiting", sup)
        assert _oom(spare) >= 500, "the standby goes first when memory runs out"
        assert _oom(child) == _oom(os.getpid()), "the trainer keeps its own"
        persister = _persister(sup.pid)
        assert persister is not None and _oom(persister) >= 500
        os.kill(child, signal.SIGCONT)
        out, _ = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        _release(held)
    text = out.decode(errors="replace")
    assert sup.returncode == 0, text[-4000:]
    assert [pid for pid, _, _ in _setups(run)] == [child], "the set-up ran in the trainer only"
    assert text.count("=== setup_effects") == 1, text[-3000:]
    _files_intact(run, 1)
    assert not alive(spare), "the standby is gone with its supervisor"
    assert_identical(reference, run)


@pytest.mark.slow
def test_kill_9_at_drawn_steps_the_set_up_runs_once_per_attempt(
    tmp_path: Path, reference: Path
) -> None:
    """Three ``kill -9`` of the trainer at drawn logged steps, each with the standby waiting:
    every recovery is the standby's, whose set-up runs after its promotion only -- with the
    ``OMP_NUM_THREADS`` the script set before ``import torch`` in force, though the standby had
    imported torch before the script ran -- and the run ends bitwise equal."""
    rng = random.Random(int(os.environ.get("UNBROKEN_TEST_SEED", "46")))
    moments = sorted(rng.sample(range(3, STEPS - 8), 3))
    run, report = tmp_path / "run", tmp_path / "report.json"
    sup = _supervise(run, report, extra=("--step-sleep", "0.05"))
    reached: list[int] = []
    spares: list[int] = []
    held: list[int] = []
    child = None
    try:
        for at in moments:
            # Three steps on from the last kill: real progress (a relaunch that trained only
            # its first step has made none).
            target = max(at, reached[-1] + 3) if reached else at

            def trained(target: int = target, prev: int | None = child) -> int | None:
                now = trainers(sup.pid)
                steps = logged_steps(run)
                ok = steps and steps[-1] >= target and len(now) == 1 and now[0] != prev
                return now[0] if ok else None

            child = _until(trained, f"a trainer logging step {target}", sup)
            held.append(child)
            os.kill(child, signal.SIGSTOP)
            spare = _until(lambda c=child: _standby(sup, c), "a standby", sup)
            _lift(spare)
            _until(lambda c=child: _standby(sup, c, waiting=True), "it waits", sup)
            assert spare not in [pid for pid, _, _ in _setups(run)], "set up before its turn"
            assert _oom(spare) >= 500
            if spares:  # the previous standby, promoted: the trainer's own score again
                assert child == spares[-1] and _oom(child) == _oom(os.getpid())
            spares.append(spare)
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
    attempts = json.loads(report.read_text())["attempts"]
    promoted = [int(m) for a in attempts for m in re.findall(PROMOTED, a["note"])]
    assert promoted == spares, attempts
    setups = _setups(run)
    assert [pid for pid, _, _ in setups] == [held[0], *spares], "once per attempt"
    assert [a for _, a, _ in setups] == ["1", "2", "3", "4"], setups
    assert {t for _, _, t in setups} == {"1"}, f"OMP_NUM_THREADS=1 lost: {setups}"
    assert text.count("=== setup_effects") == 4, text[-3000:]
    assert attempts[-1]["status"] == "ok"
    # The last attempt's log (filemode="w"): from the step after its resume to the end.
    _files_intact(run, resume_steps(run)[-1] + 1)
    assert_identical(reference, run)


def test_a_bug_is_given_up_on_after_four_launches_and_named(tmp_path: Path) -> None:
    """A NameError after every step from step 12 on (past the first snapshots) under the
    default options: every relaunch trains one step and dies at the same line. Given up after
    at most four launches, the failure named in the message (type, file:line)."""
    run, report = tmp_path / "run", tmp_path / "report.json"
    sup = _supervise(run, report, extra=("--bug-at", "12"))
    try:
        out, _ = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    text = out.decode(errors="replace")
    rep = json.loads(report.read_text())
    assert sup.returncode == 1, text[-4000:]
    assert len(rep["attempts"]) <= 4, [a["note"] for a in rep["attempts"]]
    line = next(
        i for i, t in enumerate(SCRIPT.read_text().splitlines(), 1) if "undefined_name)" in t
    )
    assert "NameError" in rep["outcome"] and f"setup_effects.py:{line}" in rep["outcome"], rep
    assert rep["outcome"] in text


# -- what the supervisor says at start-up ---------------------------------------------------

QUICK = "import sys; sys.exit(0)\n"


def _startup(tmp_path: Path, *options: str, cmd: list[str] | None = None, **env: str) -> str:
    """What ``unbroken run OPTIONS -- CMD`` says on stderr (CMD: a script that exits at once)."""
    if cmd is None:
        script = tmp_path / "quick.py"
        script.write_text(QUICK)
        cmd = [sys.executable, str(script)]
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "run", *options, "--", *cmd],
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stderr


def _said_once(text: str, what: str) -> None:
    assert text.count(what) == 1, text


def test_startup_says_the_default_standby_is_the_shallow_one(tmp_path: Path) -> None:
    text = _startup(tmp_path)
    _said_once(text, "warm standby: shallow (the default)")
    assert "nothing of the script runs" in text and "--standby deep" in text, text
    _said_once(text, "in-memory snapshots: on")


def test_startup_says_the_deep_standby_and_its_hazards(tmp_path: Path) -> None:
    text = _startup(tmp_path, "--standby", "deep")
    _said_once(text, "warm standby: deep (--standby deep)")
    for hazard in ("twice", "files", "memory", "CUDA"):
        assert hazard in text, (hazard, text)


@pytest.mark.parametrize(
    ("options", "env", "why"),
    [
        (["--no-standby"], {}, "--no-standby"),
        ([], {"UNBROKEN_STANDBY": "0"}, "UNBROKEN_STANDBY=0"),
        ([], {"WORLD_SIZE": "4"}, "WORLD_SIZE=4: one rank of several"),
        (["--no-snapshots"], {}, "no in-memory snapshots"),
    ],
    ids=["no-standby", "env-off", "one-rank-of-several", "no-snapshots"],
)
def test_startup_says_why_there_is_no_standby(
    tmp_path: Path, options: list[str], env: dict[str, str], why: str
) -> None:
    text = _startup(tmp_path, *options, **env)
    _said_once(text, "no warm standby: ")
    assert f"no warm standby: {why}" in text, text


def test_startup_says_why_a_wrapper_gets_no_standby(tmp_path: Path) -> None:
    wrapper = tmp_path / "train.sh"
    wrapper.write_text("#!/bin/sh\nexit 0\n")
    wrapper.chmod(0o755)
    text = _startup(tmp_path, cmd=[str(wrapper)])
    _said_once(text, "no warm standby: ")
    assert "not `python SCRIPT" in text and "--standby deep" in text, text


def test_startup_says_why_a_shared_rendezvous_gets_no_standby(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "torchrun"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    cmd = [str(fake), "--nnodes", "2", "--rdzv_endpoint", "head:29500", "train.py"]
    text = _startup(tmp_path, cmd=cmd)
    _said_once(text, "no warm standby: ")
    assert "rendezvous" in text, text


def test_startup_says_snapshots_are_off(tmp_path: Path) -> None:
    text = _startup(tmp_path, "--no-snapshots")
    _said_once(text, "in-memory snapshots: off (--no-snapshots)")


def test_the_trainer_says_its_snapshot_interval(tmp_path: Path) -> None:
    """Chosen by the trainer (``snapshot_every=None``: as often as keeps them under 1% of a
    step) or given: said once on stderr, whatever logging's configuration (the script logs to
    a file of its own at INFO)."""
    run, report = tmp_path / "run", tmp_path / "report.json"
    sup = _supervise(run, report, "--no-standby", extra=())
    out, _ = sup.communicate(timeout=300)
    text = out.decode(errors="replace")
    assert sup.returncode == 0, text[-3000:]
    assert len(re.findall(r"unbroken: in-memory snapshot every \d+ step", text)) == 1, text


def test_the_nodes_message_is_said_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """``in-memory snapshots across N nodes`` is a start-up decision too: on stderr, not at
    INFO (a job over several nodes is tested in tests/e2e/test_multinode.py)."""
    from unbroken.train._snapshots import say_nodes

    say_nodes(3)
    err = capsys.readouterr().err
    _said_once(err, "unbroken: in-memory snapshots across 3 nodes")


@pytest.mark.slow
def test_a_deep_standby_that_finds_cuda_initialised_refuses(tmp_path: Path) -> None:
    """``--standby deep`` with a script that initialised CUDA before ``Run()`` (faked: this
    machine may have no GPU): the standby refuses at its wait point instead of holding a second
    CUDA context, the supervisor says why and keeps a shallow standby instead, which takes
    over at the kill."""
    run, report = tmp_path / "run", tmp_path / "report.json"
    sup = _supervise(
        run, report, "--standby", "deep", extra=("--step-sleep", "0.05", "--fake-cuda")
    )
    held: list[int] = []
    try:
        _until(lambda: len(logged_steps(run)) >= 5, "step 5", sup)
        (child,) = trainers(sup.pid)
        held.append(child)
        os.kill(child, signal.SIGSTOP)

        def shallow() -> int | None:
            spare = _standby(sup, child, waiting=True)
            if spare is None:
                for pid in trainers(sup.pid) + [p for p in children(sup.pid) if p != child]:
                    if alive(pid) and not is_persister(pid):
                        _lift(pid)
                return None
            with open(f"/proc/{spare}/cmdline", "rb") as f:
                return spare if b"-c\0" in f.read() else None

        spare = _until(shallow, "a shallow standby waiting", sup)
        os.kill(child, signal.SIGKILL)
        out, _ = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        _release(held)
    text = out.decode(errors="replace")
    assert sup.returncode == 0, text[-4000:]
    _said_once(text, "the deep standby refused")
    assert "CUDA" in text
    attempts = json.loads(report.read_text())["attempts"]
    assert [int(m) for a in attempts for m in re.findall(PROMOTED, a["note"])] == [spare]


_SETS_ENV = """
import os
if {before}:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["KMP_BLOCKTIME"] = "0"
import torch
if not {before}:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["KMP_BLOCKTIME"] = "0"
print("threads", torch.get_num_threads(), flush=True)
"""


@pytest.mark.parametrize("before", [True, False], ids=["before-import-torch", "after"])
def test_the_shallow_standby_applies_what_the_script_sets_for_torch(
    tmp_path: Path, before: bool
) -> None:
    """The shallow standby imported torch before the script ran. What the script sets for
    torch *before* its ``import torch`` is what a fresh process's torch would have read:
    ``OMP_NUM_THREADS`` is applied (``torch.set_num_threads``) when the script imports torch;
    what cannot be applied afterwards (``KMP_BLOCKTIME``, read by the OpenMP runtime when it
    loads) is said on stderr. Set after ``import torch``, neither had any effect in a fresh
    process either: nothing is applied, nothing said."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: one thread either way")
    script = tmp_path / "sets_env.py"
    script.write_text(_SETS_ENV.format(before=before))
    cmd = _warm.command([sys.executable, str(script)])
    assert cmd is not None
    r, w = os.pipe()
    env = {**ENV, "UNBROKEN_SUPERVISED": "1", "UNBROKEN_STANDBY": str(r)}
    env["UNBROKEN_STOP_DIR"] = str(tmp_path / "stops")
    proc = subprocess.Popen(
        cmd, env=env, pass_fds=(r,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    os.close(r)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with open(f"/proc/{proc.pid}/comm") as f:
                    if f.read().strip() == "standby-waiting":
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.01)
        os.write(w, b"g")
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(w)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    if before:
        assert "threads 1" in out, (out, err)
        assert "KMP_BLOCKTIME" in err and "OMP_NUM_THREADS" not in err, err
    else:
        assert f"threads {torch_threads()}" in out, (out, err)
        assert "KMP_BLOCKTIME" not in err, err


def torch_threads() -> int:
    """torch's thread count in a fresh process with this environment."""
    code = "import torch; print(torch.get_num_threads())"
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True)
    return int(r.stdout)


# -- crash records: what the supervisor learns of a failure ------------------------------------


def _record(where: Path, name: str, **fields: object) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / name).write_text(json.dumps(fields))


def test_a_failure_is_named_only_when_every_rank_is_accounted_for(tmp_path: Path) -> None:
    """Under torchrun a rank SIGKILLed from outside leaves nothing, and its peer fails on the
    lost connection with an exception of its own: that exception is not the job's failure (a
    run of such kills with progress must never be given up on). A failure is named when every
    rank left a crash record or a stop marker."""
    from unbroken.process import _stops

    crash = {"type": "RuntimeError", "file": "/x/dist.py", "line": 7, "function": "f"}
    one = tmp_path / "one"
    _record(one, "crash-00000.json", rank=0, world_size=1, time=1.0, message="m", **crash)
    assert _stops.failure(str(one)) == {
        **crash,
        "message": "m",
        "rank": 0,
        "world_size": 1,
        "time": 1.0,
    }
    torchrun = tmp_path / "torchrun"
    _record(torchrun, "crash-00000.json", rank=0, world_size=2, time=1.0, **crash)
    assert _stops.failure(str(torchrun)) is None  # rank 1: nothing (killed)
    _record(torchrun, "rank-00001.json", rank=1, world_size=2, step=None)
    assert _stops.failure(str(torchrun)) is not None  # rank 1 stopped (torchrun ended it)
    two = tmp_path / "two"
    first = {**crash, "type": "NameError", "line": 3}
    _record(two, "crash-00001.json", rank=1, world_size=2, time=1.0, **first)
    _record(two, "crash-00000.json", rank=0, world_size=2, time=2.0, **crash)
    got = _stops.failure(str(two))
    assert got is not None and got["type"] == "NameError", got  # the first to fail
    assert _stops.failure(str(tmp_path / "none")) is None


def test_a_fresh_launch_reads_nothing_a_dead_standby_left(tmp_path: Path) -> None:
    """A standby that died before its promotion (a crash in its set-up, a stop) left its crash
    record or stop marker in the stop directory of the attempt it was for; the fresh launch of
    that attempt must not be judged by them."""
    from unbroken.supervise import _job

    stale = tmp_path / "attempt-2"
    _record(stale, "crash-00000.json", rank=0, world_size=1, type="NameError")
    _record(stale, "rank-00000.json", rank=0, world_size=1, step=None)
    fresh = _job.Launch([sys.executable, "-c", "pass"], dict(ENV), str(tmp_path), 2)
    assert fresh.proc.wait(timeout=60) == 0
    assert not stale.exists() or os.listdir(stale) == []
