"""Stop signals against a real training process with DataLoader workers, then relaunch.

The child (``_TRAIN``, written to the test's directory) trains a tiny model through
``unbroken.Run`` with two persistent DataLoader workers, sleeping in each step so that a signal
lands mid-step; it prints ``start N`` when it begins and ``step N`` after each step. With
``--hold-after N`` it waits after printing ``step N`` (outside any safe point) until a stop is
recorded -- or for at most 5 s once the test created ``<run_dir>.sent-N`` right after signalling
(a handler that records nothing), or 60 s -- so the signal lands where the test aims it however
loaded the machine. Every wait on a child has a timeout, and a child still running when a test
ends is killed with its group.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from unbroken import EXIT_RESUMABLE, read_metrics
from unbroken.store import CheckpointStore

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 90.0
STEPS = 15

_TRAIN = r"""
import argparse, os, signal, sys, threading, time
import torch
import unbroken

p = argparse.ArgumentParser()
p.add_argument("run_dir")
p.add_argument("--steps", type=int, default=15)
p.add_argument("--sleep", type=float, default=0.05)
p.add_argument("--save-every", type=int, default=None)
p.add_argument("--signal-during-save-at", type=int, default=None)
p.add_argument("--hold-after", type=int, default=None)
a = p.parse_args()

g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
data = torch.utils.data.TensorDataset(x, y)
loader = unbroken.MapLoader(
    data, batch_size=4, shuffle=True, seed=1, num_workers=2, persistent_workers=True
)
model = torch.nn.Linear(4, 1)
# A hand-written SGD step: constructing a torch.optim optimizer imports torch._dynamo (~1 s a
# process), and these tests are about the process, not the optimizer.
run = unbroken.Run(
    a.run_dir, model=model, loader=loader, max_steps=a.steps,
    save_every=a.save_every, progress=False, seed=0,
)

if a.signal_during_save_at is not None:
    # Fault point: SIGTERM from another thread after the tensors are written, before the commit.
    from unbroken.store import _storage
    write_tensors = _storage.write_tensors

    def write_tensors_then_signal(*args, **kwargs):
        out = write_tensors(*args, **kwargs)
        if run.counters.step == a.signal_during_save_at:
            t = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM))
            t.start()
            t.join()
            for _ in range(1000):  # the handler runs in this (main) thread, between bytecodes
                if run._stop.requested:
                    break
                time.sleep(0.001)
            print(f"fault: SIGTERM during the save of step {run.counters.step}, "
                  f"flag={run._stop.requested}", flush=True)
        return out

    _storage.write_tensors = write_tensors_then_signal

print(f"start {run.counters.step}", flush=True)
for x, y in run.loop(loader):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None
    time.sleep(a.sleep)
    run.step(loss=loss)
    print(f"step {run.counters.step}", flush=True)
    if run.counters.step == a.hold_after:
        # The test signals now; wait here (no run.step(), no fetch: no safe point) until the
        # handler recorded the stop. Sleeping, the handler runs as soon as the signal arrives.
        sent = f"{a.run_dir}.sent-{a.hold_after}"
        deadline = time.monotonic() + 60
        while not run._stop.requested and time.monotonic() < deadline:
            if os.path.exists(sent):
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.01)
print("done", flush=True)
"""


class Child:
    """A Python child process whose output lines can be awaited with a timeout."""

    def __init__(self, args: list[str], *, new_session: bool = False) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.new_session = new_session
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
            start_new_session=new_session,
        )
        self.pid = self.proc.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        self._err: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump_out, daemon=True),
            threading.Thread(target=self._pump_err, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def wait_for(self, line: str, timeout: float = TIMEOUT) -> None:
        """Block until the child prints exactly ``line``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"no {line!r} within {timeout}s; stderr:\n{self.stderr}"
                ) from None
            if got is None:
                raise AssertionError(
                    f"child exited ({self.proc.wait()}) before printing {line!r}; "
                    f"stdout: {self.stdout}\nstderr:\n{self.stderr}"
                )
            if got == line:
                return

    def finish(self, timeout: float = TIMEOUT) -> int:
        """Wait for the exit (killing the child on timeout); returns the exit code."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"child did not exit within {timeout}s:\n{self.stderr}") from None
        for t in self._threads:
            t.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            if self.new_session:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                self.proc.kill()
        self.proc.wait(timeout=30)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()
        if self.new_session:
            # Workers of a killed main process exit by themselves; make sure, by group.
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def train(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    run_dir = tmp_path / "run"

    def launch(*args: str, new_session: bool = False) -> Child:
        return Child([str(script), str(run_dir), *args], new_session=new_session)

    launch.run_dir = run_dir  # type: ignore[attr-defined]
    return launch


def _sent(run_dir: Path, step: int) -> None:
    """Tell a child held by ``--hold-after step`` that its signal was sent."""
    Path(f"{run_dir}.sent-{step}").touch()


def _latest(run_dir: Path) -> int:
    """Step of the newest checkpoint, checksums verified."""
    reader = CheckpointStore(str(run_dir)).latest(checksums=True)
    assert reader is not None, f"no valid checkpoint in {run_dir}"
    return reader.step


def _stopped_at(stderr: str, reason: str) -> int:
    marker = "unbroken: stopped at step "
    assert marker in stderr, stderr
    line = stderr[stderr.index(marker) :].splitlines()[0]
    assert f"({reason})" in line and "relaunch" in line, line
    return int(line[len(marker) :].split()[0])


def _relaunch_completes(train: Any, resume_step: int) -> None:
    """Relaunch; the child continues from ``resume_step`` and completes, logging every step once."""
    with train() as child:
        assert child.finish() == 0, child.stderr
    assert child.stdout[0] == f"start {resume_step}"
    assert child.stdout[1:] == [f"step {s}" for s in range(resume_step + 1, STEPS + 1)] + ["done"]
    assert "Traceback" not in child.stderr, child.stderr
    records = read_metrics(str(train.run_dir))
    assert [m["step"] for m in records] == list(range(1, STEPS + 1))


def test_each_stop_signal_finishes_the_step_saves_it_and_exits_75(train):
    # One run stopped by each signal in turn (a fresh process each), then completed. The
    # signal lands after step start+2 was logged (the child holds there until the stop is
    # recorded): the stop is honoured at the next safe point, the start of step start+3, so
    # nothing more is trained and step start+2 is saved.
    stop = 0
    for sig in ("SIGTERM", "SIGUSR1", "SIGINT"):
        start = stop
        with train("--hold-after", str(start + 2)) as child:
            child.wait_for(f"step {start + 2}")
            os.kill(child.pid, getattr(signal, sig))
            _sent(train.run_dir, start + 2)
            code = child.finish()
        assert code == EXIT_RESUMABLE, (sig, child.stderr)
        assert child.stdout[0] == f"start {start}", (sig, child.stdout)
        stop = _stopped_at(child.stderr, f"signal {sig}")
        assert stop == start + 2, (sig, stop)
        assert child.stdout[-1] == f"step {stop}", (sig, child.stdout)
        assert _latest(train.run_dir) == stop, sig
        assert "Traceback" not in child.stderr, child.stderr
    _relaunch_completes(train, stop)
    events = read_metrics(str(train.run_dir), events=True)
    stops = [(m["step"], m["reason"]) for m in events if m.get("event") == "stop"]
    assert [reason for _, reason in stops] == ["signal SIGTERM", "signal SIGUSR1", "signal SIGINT"]


def test_sigterm_to_the_whole_process_group_then_kill_9_then_complete(train):
    # SIGTERM reaches the main process and both DataLoader workers (as from a scheduler).
    with train("--save-every", "3", new_session=True) as child:
        child.wait_for("step 3")
        os.killpg(child.pid, signal.SIGTERM)
        code = child.finish()
    assert code == EXIT_RESUMABLE, child.stderr
    assert "Traceback" not in child.stderr and "DataLoader worker" not in child.stderr, child.stderr
    first_stop = _stopped_at(child.stderr, "signal SIGTERM")
    assert _latest(train.run_dir) == first_stop

    # kill -9 of the group one step past a checkpoint (two steps before the next; the child
    # holds after that step until killed): the log holds a step that no checkpoint has.
    kill_after = next(s for s in range(first_stop + 2, STEPS) if s % 3 == 1)
    with train("--save-every", "3", "--hold-after", str(kill_after), new_session=True) as child:
        child.wait_for(f"step {kill_after}")
        os.killpg(child.pid, signal.SIGKILL)
        assert child.finish() == -signal.SIGKILL
    assert child.stdout[0] == f"start {first_stop}"
    assert child.stdout[-1] == f"step {kill_after}", child.stdout
    saved = _latest(train.run_dir)
    assert saved == kill_after - 1
    logged = [m["step"] for m in read_metrics(str(train.run_dir))]
    assert logged[-1] > saved, "the killed process should have logged past its checkpoint"

    _relaunch_completes(train, saved)
    events = read_metrics(str(train.run_dir), events=True)
    assert [m["step"] for m in events if m.get("event") == "resume"] == [first_stop, saved]
    stops = [m for m in events if m.get("event") == "stop"]
    # A stop at a step start with that step saved already adds nothing to the log (a resume
    # keeps the log as long as its checkpoint's); one that saved a step logged it.
    assert [m["step"] for m in stops] in ([first_stop], []), stops


def test_signal_during_a_save_does_not_corrupt_it(train):
    with train("--save-every", "3", "--signal-during-save-at", "3") as child:
        code = child.finish()
    assert "fault: SIGTERM during the save of step 3, flag=True" in child.stdout, (
        child.stdout,
        child.stderr,
    )
    assert code == EXIT_RESUMABLE, child.stderr
    # The save in progress completed; the stop happened at the next safe point, the start of
    # step 4, with nothing more to save.
    assert child.stdout[-1] == "step 3", child.stdout
    assert _stopped_at(child.stderr, "signal SIGTERM") == 3
    assert "nothing to save" in child.stderr, child.stderr
    CheckpointStore(str(train.run_dir)).open(3, checksums=True)
    assert _latest(train.run_dir) == 3
    _relaunch_completes(train, 3)


def test_a_second_ctrl_c_still_ends_in_the_stop_save(train):
    # Ctrl-C twice in a step: the second asks for the same stop (said on stderr); the step is
    # saved and the exit is 75 -- never a KeyboardInterrupt raised into the step or the save.
    with train("--save-every", "1", "--sleep", "1.0") as child:
        child.wait_for("step 1")
        os.kill(child.pid, signal.SIGINT)
        time.sleep(0.2)
        os.kill(child.pid, signal.SIGINT)
        code = child.finish()
    assert code == EXIT_RESUMABLE, (code, child.stderr)
    assert "KeyboardInterrupt" not in child.stderr and "Traceback" not in child.stderr
    stop = _stopped_at(child.stderr, "signal SIGINT")
    assert stop in (1, 2), child.stderr  # at step 2's start, or its run.step()
    assert _latest(train.run_dir) == stop
    _relaunch_completes(train, stop)
