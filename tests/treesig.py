"""The tree-signal harness: stop signals sent the way schedulers send them.

SLURM (``scancel``, preemption, ``--signal``), Kubernetes and container runtimes signal *every
process of the job*: the trainer, its DataLoader workers, a launcher and its ranks. A trial here
starts a training script in a session of its own, waits for a drawn moment, then signals every
process of its tree (found through ``/proc``, in a shuffled order, as a loop over a cgroup's
tasks would) once or twice with a drawn gap, and checks the outcome:

- the process ended (a trial that outlives its deadline is a *hang*; its tree is killed);
- it exited 75 (stopped) or 0 (complete) -- never 1, never a death by signal (but for one
  that came before the handlers existed: the interpreter still starting, before the script's
  first line; counted apart);
- no traceback on stderr;
- on 75, the newest committed checkpoint (checksums verified) is the step last logged: the
  stop's save committed, and no step trained after it;
- on 0, the checkpoint says the run is complete.

An *episode* relaunches a scenario, each launch a trial, until a launch completes; the run is
then compared with an uninterrupted reference bit for bit (``tests/golden.py``). Moments are
drawn over the reference's whole life (imports, resume, training, the final save, exit), plus
"just after the final save" (when the script prints its last line). The launches run with
``UNBROKEN_SUPERVISED=1``, as under ``unbroken run``, through tests/scripts/supervised.py: the
handlers exist from the script's first line (``import unbroken``).

Used by tests/process/test_tree_signals.py (a few trials) and scripts/tree_signals.py (many).
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.golden import ROOT, assert_identical, final_state
from unbroken import EXIT_RESUMABLE, read_metrics
from unbroken.process._tree import children
from unbroken.store import CheckpointStore, scan

SCRIPTS = ROOT / "tests" / "scripts"
EXAMPLES = ROOT / "examples"
SUPERVISED = SCRIPTS / "supervised.py"  # `import unbroken` first, then the script
STOPS = ("TERM", "INT", "USR1")


@dataclass(frozen=True)
class Scenario:
    name: str
    args: tuple[str, ...]  # script and its arguments, without --run-dir
    last_line: str = "done"  # printed after the final save
    timeout: float = 240.0  # a launch's whole life, signals included
    clock_state: tuple[str, ...] = ()  # components with wall-clock fields (compared without)

    def command(self, run_dir: Path) -> list[str]:
        return [sys.executable, str(SUPERVISED), *self.args, "--run-dir", str(run_dir)]


_TREE = str(SCRIPTS / "tree_train.py")
_LM = ("--steps", "8", "--save-every", "3", "--workers", "2", "--epoch-samples", "40")
SCENARIOS = {
    s.name: s
    for s in (
        Scenario("workers-restart", (_TREE, "--loader", "map")),
        Scenario("workers-persistent", (_TREE, "--loader", "map", "--persistent")),
        Scenario("shards", (_TREE, "--loader", "shards")),
        Scenario("lightning-val", (str(SCRIPTS / "lightning_val.py"),), timeout=400),
        Scenario(
            "lightning-val-persistent",
            (str(SCRIPTS / "lightning_val.py"), "--val-persistent"),
            timeout=400,
        ),
        Scenario(
            "trainer",
            (
                str(EXAMPLES / "hf_trainer_lm.py"),
                *_LM,
                "--dim",
                "16",
                "--persistent-workers",
                "--eval-every",
                "3",
                # The Trainer takes ~45 ms a step here: enough steps that a signal 0.2 s after
                # the first save still finds the run training.
                "--steps",
                "40",
            ),
            last_line="done:",
            timeout=400,
            clock_state=("trainer_state",),  # eval_runtime, train_samples_per_second, ...
        ),
        Scenario(
            "accelerate",
            # A few ms a step here: 8 steps were done 0.1 s after the first save, before the
            # signal came (exit 0, no stop to test). Enough steps to still be training.
            (str(EXAMPLES / "accelerate_lm.py"), *_LM, "--dim", "16", "--steps", "60"),
            last_line="done:",
            timeout=400,
        ),
    )
}


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def signal_tree(pid: int, sig: int, rng: random.Random) -> int:
    """Send ``sig`` to every process of ``pid``'s tree, in a shuffled order; returns how many."""
    pids = tree(pid)
    rng.shuffle(pids)
    sent = 0
    for p in pids:
        try:
            os.kill(p, sig)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


@dataclass
class Plan:
    """When and what: ``at`` seconds after launch (or after the last line, ``after_final``,
    or after the launch's first new checkpoint, ``after_save``), then each (signal, gap
    before the next)."""

    at: float
    after_final: bool
    signals: list[tuple[str, float]]
    after_save: bool = False

    def __str__(self) -> str:
        where = f"{self.at:.2f}s after the last line" if self.after_final else f"at {self.at:.2f}s"
        where = f"{self.at:.2f}s after a new checkpoint" if self.after_save else where
        sigs = " then ".join(f"SIG{s} (+{g * 1000:.0f} ms)" for s, g in self.signals)
        return f"{where}: {sigs}"


def draw(rng: random.Random, life: float) -> Plan:
    """A moment over a launch's ``life`` (seconds, from the reference), or just after the
    final save; one or two stop signals, 0-500 ms apart."""
    after_final = rng.random() < 0.15
    at = rng.uniform(0.0, 0.3) if after_final else rng.uniform(0.0, life)
    first = rng.choice(STOPS)
    signals = [(first, rng.uniform(0.0, 0.5))]
    if rng.random() < 0.5:
        signals.append((rng.choice(STOPS), 0.0))
    return Plan(at, after_final, signals)


@dataclass
class Outcome:
    plan: Plan | None
    code: int | None  # None: hung
    signalled: int = 0  # signals sent (0: the launch ended before the moment)
    stdout: str = ""
    stderr: str = ""
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    came: bool = False  # the plan's moment came (see launch)

    @property
    def hung(self) -> bool:
        return self.code is None

    @property
    def before_handlers(self) -> bool:
        """Killed by a stop signal before the handlers existed (allowed: nothing ran)."""
        dead = self.code is not None and -self.code in (
            signal.SIGTERM,
            signal.SIGINT,
            signal.SIGUSR1,
        )
        return dead and "handlers" not in self.stdout.split()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "UNBROKEN_"))}
    env.update(PYTHONPATH=str(ROOT), UNBROKEN_SUPERVISED="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def launch(
    scenario: Scenario, run_dir: Path, plan: Plan | None, rng: random.Random | None = None
) -> Outcome:
    """One launch: signalled as ``plan`` says (None: not at all)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        scenario.command(run_dir),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    out: list[str] = []
    err: list[str] = []

    def pump_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            lines.put(line)
        lines.put(None)

    def pump_err() -> None:
        assert proc.stderr is not None
        err.extend(proc.stderr)

    pumps = [threading.Thread(target=f, daemon=True) for f in (pump_out, pump_err)]
    for t in pumps:
        t.start()
    deadline = t0 + scenario.timeout
    sent, came = 0, False
    if plan is not None:
        if _wait_moment(proc, plan, scenario, lines, deadline, run_dir):
            rng = rng or random.Random()
            for name, gap in plan.signals:
                if proc.poll() is not None:
                    break
                sent += signal_tree(proc.pid, getattr(signal, "SIG" + name), rng) > 0
                time.sleep(gap)
            # The moment came when the launch was signalled at it -- or, just after the final
            # save, when the last line was printed: a launch may exit before any signal gets
            # there, which is its contract then (exit 0) all the same.
            came = sent > 0 or plan.after_final
    try:
        code: int | None = proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = None
        for p in tree(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    for t in pumps:
        t.join(10)
    seconds = time.monotonic() - t0
    return Outcome(plan, code, sent, "".join(out), "".join(err), seconds=seconds, came=came)


def _wait_moment(
    proc: subprocess.Popen[str],
    plan: Plan,
    scenario: Scenario,
    lines: queue.Queue[str | None],
    deadline: float,
    run_dir: Path,
) -> bool:
    """Wait for the plan's moment; False when the launch ended first."""
    if plan.after_save:
        before = max((step for step, _ in scan(str(run_dir))), default=-1)
        while max((step for step, _ in scan(str(run_dir))), default=-1) <= before:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        time.sleep(plan.at)
        return proc.poll() is None
    if not plan.after_final:
        end = time.monotonic() + plan.at
        while time.monotonic() < end:
            if proc.poll() is not None:
                return False
            time.sleep(min(0.01, max(0.0, end - time.monotonic())))
        return True
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            return False
        if line.startswith(scenario.last_line):
            time.sleep(plan.at)
            return True
    return False


def check(outcome: Outcome, run_dir: Path) -> list[str]:
    """What is wrong with a launch's outcome (see the module docstring); empty when right."""
    problems = []
    code = outcome.code
    if code is None:
        return ["hang: did not exit within its deadline"]
    if code not in (0, EXIT_RESUMABLE) and not outcome.before_handlers:
        problems.append(f"exit {code}")
    if "Traceback" in outcome.stderr:
        problems.append("a traceback on stderr")
    store = CheckpointStore(str(run_dir))
    reader = store.latest(checksums=True) if os.path.isdir(run_dir) else None
    saved = reader.step if reader is not None else None
    logged = [m["step"] for m in read_metrics(str(run_dir))] if reader is not None else []
    if code == EXIT_RESUMABLE and (logged[-1] if logged else None) != saved:
        problems.append(f"stopped with step {saved} saved but step {logged[-1:]} logged")
    if code == 0:
        complete = reader is not None and reader.global_trees()["counters"].get("complete")
        if not complete:
            problems.append("exit 0 but the run is not complete")
    return problems


@dataclass
class Episode:
    outcomes: list[Outcome]
    identical: bool | None  # None: not compared (a launch went wrong first)
    difference: str = ""


def episode(
    scenario: Scenario,
    run_dir: Path,
    reference: Path,
    rng: random.Random,
    life: float,
    *,
    max_signalled: int = 6,
) -> Episode:
    """Launches, each signalled at a drawn moment, until one completes (after
    ``max_signalled`` signalled launches, one without a signal); then the golden comparison."""
    outcomes: list[Outcome] = []
    while True:
        plan = draw(rng, life) if len(outcomes) < max_signalled else None
        o = launch(scenario, run_dir, plan, rng)
        o.problems = check(o, run_dir)
        outcomes.append(o)
        if o.problems:
            return Episode(outcomes, None)
        if o.code == 0:
            break
    difference = compare(scenario, reference, run_dir)
    return Episode(outcomes, not difference, difference)


def compare(scenario: Scenario, reference: Path, run_dir: Path) -> str:
    """The golden comparison (``tests/golden.py``): '' when bitwise the same, else what differs
    first. Wall-clock fields of ``scenario.clock_state`` components are left out."""
    try:
        assert_identical(reference, run_dir, ignore=scenario.clock_state)
        for name in scenario.clock_state:
            a, b = (_without_clock(final_state(d)[1][name]) for d in (reference, run_dir))
            assert a == b, f"component {name!r} state differs (wall-clock fields aside)"
    except AssertionError as e:
        return str(e) or "differs"
    return ""


def _without_clock(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {
            k: _without_clock(v)
            for k, v in tree.items()
            if not k.endswith(("_runtime", "_per_second"))
        }
    if isinstance(tree, list):
        return [_without_clock(v) for v in tree]
    return tree


def reference(scenario: Scenario, run_dir: Path) -> float:
    """An uninterrupted run; returns its life in seconds (launch to exit)."""
    o = launch(scenario, run_dir, None)
    assert o.code == 0, f"{scenario.name}: reference exited {o.code}\n{o.stderr[-4000:]}"
    return o.seconds


def describe(o: Outcome) -> dict[str, Any]:
    return {
        "plan": str(o.plan) if o.plan else None,
        "signalled": o.signalled,
        "code": o.code,
        "seconds": round(o.seconds, 2),
        "problems": o.problems,
        "stderr_tail": o.stderr[-1500:] if o.problems else "",
    }
