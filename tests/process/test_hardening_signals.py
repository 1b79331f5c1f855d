"""Stop signals from the first line of a script to process exit, against real processes.

The child writes a marker file at the phase to hit (building data, resuming, inside the stop
save, right after it, after the final save); the test waits for the marker, then signals. Where
the child must go on only after the signal (``hold``), it waits there until the stop is recorded
-- or for at most 5 s once the test created ``<marker>.sent`` right after signalling (a handler
that records nothing), or 60 s -- so the signal lands in the phase aimed at however loaded the
machine. Each
phase must end in a resumable exit 75 -- or 0 once the final save committed -- (never a death
by signal, never a corrupt-checkpoint error, never a stop swallowed by the code it landed in),
and a relaunch must continue exactly: the runs are compared with an uninterrupted
reference (every tensor, all JSON state, the per-step losses).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.golden import ROOT, assert_identical, trainers
from unbroken import EXIT_RESUMABLE, read_metrics
from unbroken.store import CheckpointStore

TIMEOUT = 90.0
STEPS = 12

CHILD = r"""
import os, signal, sys, time
run_dir, marks, phase = sys.argv[1], sys.argv[2], sys.argv[3]

def mark(name):
    open(os.path.join(marks, name), "w").close()

def wait_here(name, seconds=30.0):
    mark(name)
    time.sleep(seconds)  # the test signals us here

def hold(name, seen):
    # The test signals us here; wait (nothing here is a safe point) until seen() says the handler
    # recorded it -- sleeping, the handler runs as soon as the signal arrives.
    mark(name)
    sent = os.path.join(marks, name + ".sent")
    deadline = time.monotonic() + 60
    while not seen() and time.monotonic() < deadline:
        if os.path.exists(sent):
            deadline = min(deadline, time.monotonic() + 5)
        time.sleep(0.01)

def stop_recorded():
    from unbroken.process import _signals
    active = _signals._active
    return _signals.pending() is not None or (active is not None and active.requested)

if phase == "early-call":
    import unbroken
    unbroken.install_signal_handlers()  # the documented first line
    wait_here("imports")
if phase == "supervised":  # UNBROKEN_SUPERVISED=1: handled from `import unbroken`
    import unbroken
    wait_here("imports")
if phase == "swallowed":  # a slow import inside a library's catch-all, then the Run
    import torch
    import unbroken
    from unbroken import Run  # imported now: the Run below starts at once
    unbroken.install_signal_handlers()
    try:
        hold("imports", stop_recorded)
    except BaseException:
        pass  # e.g. an optional-dependency probe: whatever went wrong, go on
if phase == "chain":
    def previous(signum, frame):  # e.g. Lightning's SLURM requeue handler on SIGUSR1
        with open(os.path.join(marks, "previous-called"), "w") as f:
            f.write(f"{signal.Signals(signum).name} stop={run._stop.requested}")
    signal.signal(signal.SIGUSR1, previous)

import torch
import unbroken

unbroken.seed_everything(0)
g = torch.Generator().manual_seed(0)
x, y = torch.randn(96, 4, generator=g), torch.randn(96, 1, generator=g)
loader = unbroken.MapLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True,
                             seed=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(8, 1))

class SlowResume:
    # A component whose restore takes a while (a big model, a slow disk): the resume phase.
    def state_dict(self):
        return {"n": 1}
    def load_state_dict(self, state):
        if phase == "resume":
            hold("resuming", stop_recorded)

extra = {"slow": SlowResume()}
options = dict(max_steps=int(os.environ.get("STEPS", "12")), save_every=4, progress=False)
if phase == "time-limit":
    time.sleep(2.0)  # imports and data building eat the budget too
    options["time_limit"] = 2.5
    options["time_margin"] = 0.2
run = unbroken.Run(run_dir, model=model, loader=loader, **extra, **options)
print(f"start {run.counters.step}", flush=True)

if phase == "second-int":
    from unbroken.store import _storage
    write = _storage.write_tensors
    def slow_write(*a, **k):
        if run._stop.requested:
            hold("in-stop-save", lambda: run._stop.count >= 2)  # the test presses Ctrl-C again
        return write(*a, **k)
    _storage.write_tensors = slow_write
if phase == "after-stop-save":
    halt = type(run)._halt
    def halt_slowly(self, reason, **kw):
        hold("stop-saved", lambda: run._stop.count >= 2)  # the test sends a second SIGTERM
        return halt(self, reason, **kw)
    type(run)._halt = halt_slowly

for xb, yb in run.loop(loader):
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
            p.grad = None
    run.step(loss=loss)
    if run.counters.step == int(os.environ.get("FIRST", "0")):
        # the first signal lands here, after this step, before the next
        hold(f"step-{run.counters.step}", lambda: run._stop.requested)
    else:
        mark(f"step-{run.counters.step}")
if phase == "after-final":
    hold("finished", stop_recorded)
print("done", flush=True)
"""


class Child:
    def __init__(self, tmp: Path, run_dir: Path, phase: str, **env: str) -> None:
        self.marks = tmp / f"marks-{phase}-{time.monotonic_ns()}"
        self.marks.mkdir()
        script = tmp / "child.py"
        script.write_text(CHILD)
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        full_env.pop("UNBROKEN_SUPERVISED", None)
        full_env.update(env)
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(run_dir), str(self.marks), phase],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_mark(self, name: str) -> None:
        self.waited = name
        deadline = time.monotonic() + TIMEOUT
        while not (self.marks / name).exists():
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise AssertionError(f"exited {self.proc.returncode} before {name}:\n{err}")
            assert time.monotonic() < deadline, f"no {name} within {TIMEOUT}s"
            time.sleep(0.005)

    def signal(self, sig: int) -> None:
        """Send ``sig``, then tell a child holding at the marker waited for that it was sent."""
        self.proc.send_signal(sig)
        (self.marks / f"{self.waited}.sent").touch()

    def finish(self) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"child did not exit:\n{err}") from None
        return self.proc.returncode, out, err


def run_child(tmp: Path, run_dir: Path, phase: str = "plain", **env: str) -> tuple[int, str, str]:
    return Child(tmp, run_dir, phase, **env).finish()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ref")
    code, out, err = run_child(tmp, tmp / "run")
    assert code == 0, err
    return tmp / "run"


@pytest.mark.parametrize("phase", ["early-call", "supervised"])
def test_sigterm_while_importing_or_building_data_is_a_resumable_exit(tmp_path, phase):
    # The child sleeps 30 s "importing" and never reaches a Run: the stop is recorded, and
    # with no Run to honour it the process exits 75 a few seconds later.
    env = {"UNBROKEN_SUPERVISED": "1"} if phase == "supervised" else {}
    child = Child(tmp_path, tmp_path / "run", phase, **env)
    child.wait_mark("imports")
    t0 = time.monotonic()
    child.signal(signal.SIGTERM)
    code, out, err = child.finish()
    assert code == EXIT_RESUMABLE, (code, err)
    assert time.monotonic() - t0 < 20, "the stop waited for the end of the 'import'"
    assert "SIGTERM at start-up, no Run came to save" in err and "Traceback" not in err, err


def test_a_stop_during_start_up_is_not_swallowed_by_a_catch_all(tmp_path):
    """The handler records the stop instead of raising it into the code it lands in (there an
    ``except BaseException`` would swallow it and the run would train to the end): ``Run()``
    honours it, exit 75 before any training."""
    child = Child(tmp_path, tmp_path / "run", "swallowed")
    child.wait_mark("imports")
    child.signal(signal.SIGTERM)
    code, out, err = child.finish()
    assert code == EXIT_RESUMABLE, (code, out, err)
    # Run() honours it (or, on a machine so slow that Run() comes after the 5 s start-up
    # grace, the start-up backstop does): either way no step is trained.
    said = ("SIGTERM while not training", "SIGTERM at start-up, no Run came to save")
    assert any(s in err for s in said) and "Traceback" not in err, err
    assert "start" not in out, out
    assert CheckpointStore(str(tmp_path / "run")).latest() is None


def _stopped_at(err: str) -> int:
    return int(err.split("stopped at step ")[1].split()[0])


def test_every_phase_of_a_run_stops_resumably_and_the_run_resumes_exactly(tmp_path, reference):
    """One run directory through every phase, a fresh process each, then compared with the
    uninterrupted reference bit for bit:

    1. SIGUSR1 after step 3 with a previous Python handler installed (Lightning's SLURM
       requeue, say): the stop is recorded, then the previous handler is called; step 3 is
       saved at the next safe point (step 4's start), exit 75.
    2. SIGTERM while resuming (a slow component restore): exit 75, nothing lost.
    3. SIGTERM after step 5, and a second SIGTERM right after the stop save: still exit 75.
    4. Ctrl-C after step 7, and a second Ctrl-C inside the stop save: the save commits, then
       exit 75 -- not a corrupt checkpoint, not a traceback.
    5. To completion, then SIGTERM after the final save: exit 0 (the run is complete); a
       relaunch finds it done.
    """
    run_dir = tmp_path / "run"

    child = Child(tmp_path, run_dir, "chain", FIRST="3")
    child.wait_mark("step-3")
    child.signal(signal.SIGUSR1)
    code, out, err = child.finish()
    assert (child.marks / "previous-called").read_text() == "SIGUSR1 stop=True"
    assert code == EXIT_RESUMABLE and _stopped_at(err) == 3, (code, err)
    assert "stopped at step 3 (signal SIGUSR1)" in err, err

    child = Child(tmp_path, run_dir, "resume")
    child.wait_mark("resuming")
    child.signal(signal.SIGTERM)
    code, out, err = child.finish()
    assert code == EXIT_RESUMABLE, (code, err)
    assert "SIGTERM while not training" in err and "Traceback" not in err, err
    assert CheckpointStore(str(run_dir)).latest().step == 3

    child = Child(tmp_path, run_dir, "after-stop-save", FIRST="5")
    child.wait_mark("step-5")
    child.signal(signal.SIGTERM)
    child.wait_mark("stop-saved")
    child.signal(signal.SIGTERM)
    code, out, err = child.finish()
    assert out.splitlines()[0] == "start 3", out
    assert code == EXIT_RESUMABLE, (code, err)  # not -15 (143 in a shell)
    assert "stopped at step 5 (signal SIGTERM)" in err, err

    child = Child(tmp_path, run_dir, "second-int", FIRST="7")
    child.wait_mark("step-7")
    child.signal(signal.SIGINT)
    child.wait_mark("in-stop-save")
    child.signal(signal.SIGINT)
    code, out, err = child.finish()
    assert code == EXIT_RESUMABLE, (code, err)
    assert "CorruptCheckpointError" not in err and "Traceback" not in err, err
    assert "stopped at step 7 (signal SIGINT)" in err, err
    CheckpointStore(str(run_dir)).open(7, checksums=True)  # committed, whole

    child = Child(tmp_path, run_dir, "after-final")
    child.wait_mark("finished")
    child.signal(signal.SIGTERM)
    code, out, err = child.finish()
    assert out.splitlines()[0] == "start 7", out
    assert code == 0, (code, err)  # complete: the signal changes nothing
    assert_identical(reference, run_dir)
    events = read_metrics(run_dir, events=True)
    assert [m["step"] for m in events if m.get("event") == "stop"] == [3, 5, 7]
    code, out, err = run_child(tmp_path, run_dir)
    assert code == 0 and out.splitlines() == ["start 12", "done"], (out, err)


def test_time_limit_counts_from_process_start(tmp_path):
    """2 s of imports and data building, then a 2.5 s budget (0.2 s margin): the run must stop
    within a step or two, not train for seconds more as a budget counted from Run() would."""
    run_dir = tmp_path / "run"
    code, out, err = run_child(tmp_path, run_dir, "time-limit", STEPS="100000")
    assert code == EXIT_RESUMABLE, (code, err)
    assert "(time limit)" in err, err
    logged = read_metrics(run_dir, events=True)
    stop = next(m for m in logged if m.get("event") == "stop")
    assert stop["step"] <= 3, stop


_SUPERVISED = """\
import os, signal, sys, time
marks = sys.argv[1]
if os.environ["UNBROKEN_ATTEMPT"] == "1":
    open(os.path.join(marks, "started"), "w").close()
    time.sleep(30)  # "importing": no handler yet, so SIGTERM kills it (-15)
sys.exit(0)
"""


def test_supervisor_treats_a_child_killed_by_sigterm_at_start_up_as_resumable(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_SUPERVISED)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UNBROKEN_"))}
    env["PYTHONPATH"] = str(ROOT)
    sup = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unbroken",
            "run",
            "--json",
            str(report),
            "--backoff",
            "30",
            "--",
            sys.executable,
            str(script),
            str(marks),
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + TIMEOUT
    while not (marks / "started").exists():
        assert sup.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    # Killed by SIGTERM from outside the supervisor (a scheduler's kill of the child alone):
    # relaunched at once as a resumable stop, not retried after a 30 s crash backoff.
    os.kill(_child_of(sup.pid), signal.SIGTERM)
    _, err = sup.communicate(timeout=TIMEOUT)
    assert sup.returncode == 0, err
    rep = json.loads(report.read_text())
    first = rep["attempts"][0]
    assert first["signal"] == "SIGTERM" and first["status"] == "resumable", first
    assert first["action"] == "relaunch" and first["backoff_s"] == 0, first


def _child_of(pid: int) -> int:
    kids = trainers(pid)  # not the supervisor's persister
    assert len(kids) == 1, kids
    return kids[0]


def test_supervisor_stop_forwarded_to_a_child_still_starting_is_resumable(tmp_path):
    """SIGTERM to the supervisor while its child is still starting (no handler yet): the child
    dies by the forwarded SIGTERM, and that is a resumable stop (75), not a crash (1)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_SUPERVISED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UNBROKEN_"))}
    env["PYTHONPATH"] = str(ROOT)
    sup = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--", sys.executable, str(script), str(marks)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + TIMEOUT
    while not (marks / "started").exists():
        assert sup.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    sup.send_signal(signal.SIGTERM)
    _, err = sup.communicate(timeout=TIMEOUT)
    assert sup.returncode == EXIT_RESUMABLE, err
    assert "killed by SIGTERM (resumable) -> stop" in err, err
