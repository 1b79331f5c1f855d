"""Run a training command twice -- straight through, then interrupted K times and relaunched --
and compare the two runs.

The command learns its run directory from ``{run_dir}`` in its arguments (replaced in each
argument) or from the environment variable :data:`ENV_RUN_DIR`; :data:`ENV_KEEP_ALL` makes
its ``Run`` keep every checkpoint, so both runs can be compared at every save step.

A signal goes to every process of the launch -- the command, everything below it, and what
a launcher started in sessions of its own (torchrun's ranks) -- as a cluster's preemption
would (:mod:`unbroken.process._tree`). A launch whose ranks all saved and stopped (their stop
markers, :mod:`unbroken.process._stops`) is a stop whatever the launcher's exit code (torchrun
exits 1 when its ranks exit 75). After a SIGKILL no step may be logged: one would mean a process of
the job survived the kill and trained on. Moments are watched from outside: a step target fires when
``RUN/metrics.jsonl`` logs that step; a save target fires (SIGKILL) as soon as the save's
``checkpoints/.tmp-step-N`` directory appears.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ..errors import ConfigError
from ..process import _protocol, _stops, _tree
from ..process._exit import EXIT_OK, EXIT_RESUMABLE
from ..process._logfile import METRICS_FILE, last_logged_step
from ..store import _layout
from ._findings import Comparison, comparison_from_json
from ._forkserver import ForkServer, forkable, preloads
from ._plan import Target, next_target, plan_interrupts
from ._report import Interruption, VerifyReport, hints_for, parted
from ._unverifiable import ScriptFailedError, VerifyError

PLACEHOLDER = "{run_dir}"
ENV_RUN_DIR = _protocol.RUN_DIR
ENV_KEEP_ALL = _protocol.KEEP_ALL
MARKER = ".unbroken-verify"
_POLL = 0.002  # seconds between looks at the metrics log
_SPIN = 0.0005  # while waiting for a save to start: short, so a save of a millisecond is seen

Progress = Callable[[str], None]
StepProgress = Callable[[str, int, "int | None"], None]
"""``(label, last logged step, total steps or None)``, about twice a second while a launch runs."""
_TICK = 0.5
PROCESS, FORK = "process", "fork"
"""How a launch started: the command as a new process, or forked from the fork server."""


def verify_resume(
    cmd: Sequence[str],
    *,
    interrupts: int = 3,
    seed: int = 0,
    atol: float = 0.0,
    rtol: float = 0.0,
    work_dir: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    ignore: Sequence[str] = (),
    keep: bool = False,
    progress: Progress | None = None,
    step_progress: StepProgress | None = None,
    fork: bool = True,
    side_by_side: bool | None = None,
) -> VerifyReport:
    """Check that ``cmd``, interrupted and relaunched, ends exactly like an uninterrupted run.

    Runs ``cmd`` to completion in a fresh run directory, then again while interrupting it
    ``interrupts`` times (SIGKILL, SIGTERM, and with 2 or more one SIGKILL during a save; the
    moments are drawn from ``seed``), relaunching until it exits 0, and compares every tracked
    tensor and value at every checkpoint step both runs hold, and the per-step metrics log.
    A difference is not an error: it is in the returned report. Raises ConfigError for a
    bad argument and VerifyError when the command fails, times out or writes no checkpoint::

        report = unbroken.verify_resume(["python", "train.py", "--run-dir", "{run_dir}"])
        assert report.passed, report.summary()

    ``timeout`` bounds both runs together (seconds). ``work_dir`` keeps the run directories
    there (``reference/``, ``interrupted/``, with the logs of every launch); by default a
    temporary directory, removed when the check passes unless ``keep``. ``progress`` gets a
    line per phase and launch; ``step_progress(label, step, total)`` the step a launch has
    logged, about twice a second (the CLI draws a bar with it).

    What it costs: the interrupted run trains beside the reference (``side_by_side``; by
    default where the machine has two cores or more), planned from the ``max_steps`` and
    ``save_every`` its Run told (``step_progress`` then follows the interrupted run alone); the
    reference is a new process, and every launch of the interrupted run (the one killed during
    a save too) is forked from an interpreter that imported torch once (``fork``; ``python
    SCRIPT`` and ``python -m MODULE`` commands), which also runs the comparison, so that
    verify's own process never imports torch. The report says which launch was which.
    """
    argv = _check_command(cmd)
    _check_options(interrupts, atol, rtol, timeout)
    work, owned = _prepare_work(work_dir)
    say = progress or (lambda _msg: None)
    deadline = None if timeout is None else time.monotonic() + timeout
    if side_by_side is None:
        # Not for a launcher (torchrun, a shell wrapper): two jobs at once would meet at its
        # rendezvous port (EADDRINUSE), or at whatever else it holds for one job at a time.
        single = forkable(argv)
        launcher = single is None or (single[1] and single[0].startswith("torch.distributed"))
        side_by_side = _cores() >= 2 and not launcher
    base = dict(os.environ)
    if side_by_side and interrupts > 0 and "OMP_NUM_THREADS" not in base:
        # Two runs of torch's default (a thread per core) on the same cores oversubscribe
        # them, and OpenMP threads spinning for each other can make both slower than one
        # after the other. Every launch of both runs gets the same setting.
        base["OMP_NUM_THREADS"] = str(max(1, _cores() // 2))
    ref = _Session(argv, work, deadline, say, base)
    s = _Session(argv, work, deadline, say, base)
    s.tick = step_progress
    notes = []
    if not any(PLACEHOLDER in a for a in argv):
        notes.append(
            f"no {PLACEHOLDER} in the command: it was told the run directory by the "
            f"environment variable {ENV_RUN_DIR}"
        )
    if fork and interrupts > 0 and forkable(argv) is not None:
        # Started now: it imports torch while the reference run, a new process, starts.
        env = _protocol.verify_env(base, run_dir=work)
        target, module, _ = forkable(argv) or ("", True, [])
        preload = [] if module else preloads(target)  # the script's frameworks, imported once
        s.forks = ForkServer(argv[0], env, os.path.join(work, "forkserver.log"), preload)
    elif fork and interrupts > 0:
        notes.append(
            "every launch a new process: only `python SCRIPT.py ...` and `python -m MODULE "
            "...` commands are forked from a pre-imported interpreter"
        )
    ref_dir = os.path.join(work, "reference")
    other_dir = os.path.join(work, "interrupted")
    ref_thread = _Background(ref.reference, ref_dir) if side_by_side and interrupts > 0 else None
    if ref_thread is None:
        ref.tick = step_progress  # side by side, progress follows the interrupted run alone
    t0 = time.perf_counter()
    try:
        if ref_thread is not None:
            ref_thread.start()
            schedule = _wait_schedule(ref, ref_thread, notes)
        else:
            schedule = None
        if schedule is None:  # plan from what the reference did, once it is done
            total, save_steps = ref_thread.result() if ref_thread else ref.reference(ref_dir)
            planned_from = None
        else:
            total, save_steps = schedule
            planned_from = schedule
            say(
                f"planning from the reference's Run (max_steps={total}); the interrupted run "
                "trains beside it"
            )
        t1 = time.perf_counter()
        plan = plan_interrupts(interrupts, seed, total, save_steps)
        if interrupts > len(plan):
            notes.append(f"{interrupts} interruptions asked for, {len(plan)} fit in {total} steps")
        say(
            "plan: "
            + (", ".join(f"SIG{t.signal} at {t.moment}" for t in plan) or "no interruption")
        )
        try:
            outcome = s.interrupted(other_dir, plan, total, save_steps)
        except BaseException:
            if ref_thread is not None and ref_thread.error() is not None:
                ref_thread.result()  # the reference's failure explains the chain's
            raise
        t2 = time.perf_counter()
        if ref_thread is not None and planned_from is not None:
            total, save_steps = ref_thread.result()
            if (total, save_steps) != planned_from:
                notes.append(
                    f"the interruptions were planned from the Run's max_steps and save_every "
                    f"({planned_from[0]} steps, saves at {planned_from[1]}); the reference ran "
                    f"{total} steps, saved at {save_steps}"
                )
        t_ref = ref_thread.seconds if ref_thread is not None else t1 - t0
        say(f"comparing the runs in {work}")
        cmp = s.compare(ref_dir, other_dir, atol=atol, rtol=rtol, ignore=ignore, notes=notes)
    finally:
        if ref_thread is not None:
            ref.aborted.set()
            ref_thread.join()
        if s.forks is not None:
            s.forks.close()
    report = VerifyReport(
        passed=cmp.passed,
        command=list(argv),
        seed=seed,
        reference_steps=total,
        checkpoints_compared=cmp.steps,
        metrics_compared=cmp.metrics_steps,
        interruptions=outcome.interruptions,
        launches=outcome.launches,
        resumed_from=outcome.resumed_from,
        launched=outcome.launched,
        reference_launched=ref.launched,
        side_by_side=ref_thread is not None,
        differences=cmp.differences,
        hints=hints_for(cmp, outcome.resumed_from),
        not_compared=cmp.not_compared,
        parted=parted(cmp, outcome.resumed_from),
        work_dir=work,
        notes=notes + outcome.notes,
    )
    report.seconds = {
        "reference": t_ref,
        "interrupted": t2 - t1,
        "compare": time.perf_counter() - t2,
        "total": time.perf_counter() - t0,
    }
    if report.passed and owned and not keep:
        shutil.rmtree(work, ignore_errors=True)
        report.work_dir = None
    return report


def _check_command(cmd: Any) -> list[str]:
    if isinstance(cmd, (str, bytes)) or not isinstance(cmd, Sequence):
        raise ConfigError(
            f"cmd must be a list of arguments (e.g. shlex.split(...)), got {type(cmd).__name__}"
        )
    argv = list(cmd)
    if not argv:
        raise ConfigError("cmd is empty: give the training command, e.g. ['python', 'train.py']")
    bad = [a for a in argv if not isinstance(a, str)]
    if bad:
        raise ConfigError(f"cmd must hold strings only, got {bad[0]!r}")
    exe = argv[0]
    if not (shutil.which(exe) or (os.sep in exe and os.path.isfile(exe))):
        raise ConfigError(f"cmd: {exe!r} is not an executable found on PATH")
    return argv


def _check_options(interrupts: Any, atol: float, rtol: float, timeout: float | None) -> None:
    if not isinstance(interrupts, int) or isinstance(interrupts, bool) or interrupts < 0:
        raise ConfigError(f"interrupts must be an integer >= 0, got {interrupts!r}")
    for name, v in (("atol", atol), ("rtol", rtol)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"timeout must be > 0 seconds or None, got {timeout!r}")


def _prepare_work(work_dir: str | os.PathLike[str] | None) -> tuple[str, bool]:
    """(directory, created here). A given directory may be reused only if verify made it."""
    if work_dir is None:
        work = tempfile.mkdtemp(prefix="unbroken-verify-")
        open(os.path.join(work, MARKER), "w").close()
        return work, True
    work = os.path.abspath(os.fspath(work_dir))
    os.makedirs(work, exist_ok=True)
    subdirs = [os.path.join(work, n) for n in ("reference", "interrupted")]
    if any(os.path.lexists(p) for p in subdirs):
        if not os.path.exists(os.path.join(work, MARKER)):
            raise ConfigError(
                f"work_dir {work} holds reference/ or interrupted/ not made by unbroken verify; "
                "choose an empty directory"
            )
        for p in subdirs:
            shutil.rmtree(p, ignore_errors=True)
    open(os.path.join(work, MARKER), "w").close()
    return work, False


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Background(threading.Thread):
    """The reference run, beside the interrupted one: its result or its error, and its time."""

    def __init__(self, fn: Callable[[str], tuple[int, list[int]]], run_dir: str) -> None:
        super().__init__(name="unbroken-verify-reference", daemon=True)
        self._fn, self._dir = fn, run_dir
        self._result: tuple[int, list[int]] | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._result = self._fn(self._dir)
        except BaseException as e:  # handed to the main thread by result()
            self._error = e
        self.seconds = time.perf_counter() - t0

    def error(self) -> BaseException | None:
        self.join(0)
        return None if self.is_alive() else self._error

    def result(self) -> tuple[int, list[int]]:
        self.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def _wait_schedule(
    ref: _Session, thread: _Background, notes: list[str]
) -> tuple[int, list[int]] | None:
    """The reference's planned steps and save steps, as its Run told them (max_steps,
    save_every) when it opened; None if it told no such thing before it ended (no
    max_steps, saves by the clock) or it uses CUDA: the plan waits for the run then."""
    where = os.path.join(ref.work, "stops", "reference-1")
    while thread.is_alive():
        told = _stops.read_schedule(where)
        if told is not None:
            total, every = told
            if every is None:
                return None
            tree = ref._tree
            if tree is not None and any(_uses_cuda(pid) for pid in tree.members()):
                notes.append(
                    "the reference run uses CUDA: the interrupted run trained after it, not "
                    "beside it (one GPU's memory may not hold two runs)"
                )
                return None
            return total, sorted({*range(every, total + 1, every), total})
        time.sleep(0.01)
    return None


def _uses_cuda(pid: int) -> bool:
    """The process has the CUDA driver loaded (torch loads it when it first uses CUDA)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return b"libcuda.so" in f.read()
    except OSError:
        return False


@dataclass(slots=True)
class _Outcome:
    interruptions: list[Interruption] = field(default_factory=list)
    launches: int = 0
    launched: list[str] = field(default_factory=list)
    resumed_from: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Session:
    def __init__(
        self,
        argv: list[str],
        work: str,
        deadline: float | None,
        say: Progress,
        base: dict[str, str] | None = None,
    ):
        self.argv, self.work, self.deadline, self.say = argv, work, deadline, say
        self.base = dict(os.environ) if base is None else base  # the launches' environment
        self.tick: StepProgress | None = None
        self._live: tuple[str, str, int | None] = ("", "", None)  # label, run dir, total
        self._tree: _tree.Tree | None = None  # the current launch's processes
        self._stop_dir = ""  # where its ranks leave their stop markers
        self._killed_at: int | None = None  # the step logged when a SIGKILL had landed
        self.forks: ForkServer | None = None  # relaunches fork from it (None: processes)
        self._forks_ok: bool | None = None  # the server said it can fork (None: not asked)
        self.aborted = threading.Event()  # the other run failed or verify is ending: stop
        self.launched = PROCESS  # how the reference started

    def _show(self) -> None:
        label, run_dir, total = self._live
        if self.tick is not None and run_dir:
            self.tick(label, last_logged_step(run_dir), total)

    # ---- the two runs -------------------------------------------------------------------------

    def reference(self, run_dir: str) -> tuple[int, list[int]]:
        self.say(f"reference run (uninterrupted) in {run_dir}")
        t0 = time.perf_counter()
        # A new process, started at once (the fork server imports torch meanwhile): compared
        # with the interrupted run, whose launches are forked, it shows a script that does not
        # repeat itself from a new process on.
        self.launched = PROCESS
        proc, log = self._start(run_dir, "reference", 1)
        self._live = ("reference", run_dir, None)
        try:
            code = self._finish(proc, log)
        finally:
            self._reap(proc)  # e.g. on Ctrl-C: the command runs in its own session
        if code == EXIT_RESUMABLE:
            raise VerifyError(
                f"the reference run exited {EXIT_RESUMABLE} (saved and stopped) without being "
                "interrupted -- a time limit? verify needs a run that completes in one launch; "
                f"log: {log.name}"
            )
        if code != EXIT_OK:
            self._fail("the reference run", code, log.name)
        save_steps = sorted(s for s, _ in _layout.scan(run_dir))
        if not save_steps:
            raise VerifyError(
                f"the command wrote no checkpoint into {run_dir}: give it the run directory "
                f"with {PLACEHOLDER} in its arguments or read os.environ[{ENV_RUN_DIR!r}], and "
                f"pass that to unbroken.Run; log: {log.name}"
            )
        total = max(last_logged_step(run_dir), save_steps[-1])
        steps = ", ".join(map(str, save_steps))
        took = time.perf_counter() - t0
        self.say(f"reference: {total} steps, checkpoints at {steps} ({took:.1f} s)")
        return total, save_steps

    def interrupted(
        self, run_dir: str, plan: list[Target], total: int, save_steps: list[int]
    ) -> _Outcome:
        self.say(f"interrupted run in {run_dir}")
        out = _Outcome()
        pending = list(plan)
        last_seen, stalls = 0, 0
        while True:
            target = next_target(pending, last_seen, total, save_steps, out.notes)
            out.launches += 1
            if out.launches > len(plan) + 10:
                raise VerifyError(
                    f"the interrupted run did not complete after {out.launches - 1} launches; "
                    f"log: {os.path.join(self.work, 'interrupted.log')}"
                )
            if out.launches > 1:
                out.resumed_from.append(_latest_committed(run_dir))
            # Every launch is forked where the command can be: the reference, a new process,
            # is what a start-up from a new interpreter is compared against.
            how = FORK if self._can_fork(out.notes) else PROCESS
            out.launched.append(how)
            proc, log = self._start(run_dir, "interrupted", out.launches, fork=how == FORK)
            self._live = (f"interrupted, launch {out.launches}", run_dir, total)
            try:
                hit = None if target is None else self._watch(proc, run_dir, target, save_steps)
                code = self._settle(self._finish(proc, log), log.name)
            finally:
                self._reap(proc)
            fired = hit is not None
            at = last_logged_step(run_dir)
            if hit is not None and hit.signal == "KILL":
                self._check_stopped(at, hit, log.name)
            leftover = _leftover_save(run_dir)
            label = f"launch {out.launches}: "
            if hit is not None and target is not None:
                pending.remove(target)
                during = leftover is not None
                sig = "SIG" + hit.signal
                out.interruptions.append(
                    Interruption(out.launches, sig, hit.moment, at, code, during, how)
                )
                label += f"SIG{hit.signal} at {hit.moment}, "
                if code == EXIT_OK:
                    out.notes.append(
                        f"SIG{hit.signal} at {hit.moment} came too late: the run had completed"
                    )
            self.say(label + _exit_text(code, at, leftover) + (" [forked]" if how == FORK else ""))
            if code == EXIT_OK:
                break
            # A SIGKILL ends the launch however its launcher reports it (torchrun may see its
            # ranks die before it is killed itself, and exit 1).
            killed = fired and (hit is not None and hit.signal == "KILL" or code < 0)
            if code == EXIT_RESUMABLE or killed or code == -signal.SIGKILL:
                stalls = stalls + 1 if not fired and at <= last_seen else 0
                if stalls > 2:
                    raise VerifyError(f"the interrupted run keeps stopping at step {at}")
                last_seen = max(last_seen, at)
                continue
            self._fail(f"launch {out.launches} of the interrupted run", code, log.name)
        if pending:
            out.notes.append(
                f"{len(pending)} planned interruption(s) not made: the run completed first"
            )
        return out

    # ---- the comparison -----------------------------------------------------------------------

    def compare(
        self,
        ref_dir: str,
        other_dir: str,
        *,
        atol: float,
        rtol: float,
        ignore: Sequence[str],
        notes: list[str],
    ) -> Comparison:
        """compare_runs, in a child of the fork server where there is one (it imported torch:
        verify's own process never does), else here."""
        if self.forks is not None and self._can_fork(notes):
            try:
                found = self._compare_forked(ref_dir, other_dir, atol, rtol, list(ignore))
            except OSError:
                found = None
            if found is not None:
                return found
            notes.append(
                "the comparison could not run in a child of the fork server (compare.log in "
                "the work directory): it ran in verify's own process"
            )
        from ._compare import compare_runs  # imports torch

        return compare_runs(ref_dir, other_dir, atol=atol, rtol=rtol, ignore=ignore)

    def _compare_forked(
        self, ref_dir: str, other_dir: str, atol: float, rtol: float, ignore: list[str]
    ) -> Comparison | None:
        assert self.forks is not None
        job, out = (os.path.join(self.work, f"compare.{x}") for x in ("job.json", "json"))
        if os.path.exists(out):
            os.remove(out)  # an earlier verify's, in a reused work directory
        spec = {"ref": ref_dir, "other": other_dir, "atol": atol, "rtol": rtol}
        with open(job, "w") as f:
            json.dump({**spec, "ignore": ignore, "out": out}, f)
        argv = [self.argv[0], "-m", f"{__package__}._compare_job", job]
        # verify's own unbroken, whatever the command's interpreter finds first
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = _protocol.verify_env(self.base, run_dir=self.work)
        log = os.path.join(self.work, "compare.log")
        proc = self.forks.spawn(argv, env, os.getcwd(), log, path=[root])
        proc.wait()
        try:
            with open(out) as f:
                result = json.load(f)
        except (OSError, ValueError):
            return None
        if "error" in result:
            raise VerifyError(result["error"])
        return comparison_from_json(result["comparison"])

    # ---- processes ----------------------------------------------------------------------------

    def _can_fork(self, notes: list[str]) -> bool:
        if self.forks is not None and self._forks_ok is None:
            left = self._remaining()
            self._forks_ok = self.forks.ready(120 if left is None else max(min(left, 120), 1))
            if not self._forks_ok:
                notes.append(
                    "the fork server could not start (forkserver.log in the work directory): "
                    "every launch a new process"
                )
        return bool(self._forks_ok)

    def _start(self, run_dir: str, name: str, launch: int, *, fork: bool = False) -> tuple[Any, IO]:
        argv = [a.replace(PLACEHOLDER, run_dir) for a in self.argv]
        tag = _tree.new_tag()
        self._stop_dir = os.path.join(self.work, "stops", f"{name}-{launch}")
        env = _protocol.verify_env(self.base, run_dir=run_dir)
        env = _protocol.launch_env(env, job_tag=tag, stop_dir=self._stop_dir)
        self._killed_at = None
        log = open(os.path.join(self.work, f"{name}.log"), "ab")
        log.write(f"=== launch {launch}: {' '.join(argv)}\n".encode())
        log.flush()
        try:
            if fork:
                assert self.forks is not None
                proc: Any = self.forks.spawn(argv, env, os.getcwd(), log.name)
            else:
                proc = subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        except OSError as e:
            log.close()
            raise VerifyError(f"could not start {argv[0]!r}: {e}") from e
        self._tree = _tree.Tree(proc.pid, tag)
        return proc, log

    def _settle(self, code: int, log_path: str) -> int:
        """After the launch's first process exited: wait for the rest of the job (ranks a
        launcher left behind), then read the stop markers -- every rank saved and stopped is
        a stop (75) whatever the launcher's exit code."""
        tree = self._tree
        if tree is not None and code != EXIT_OK:
            left = self._remaining()
            if tree.wait_gone(None if left is None else max(left, 0.0)):
                tree.kill()
                raise VerifyError(
                    f"timed out waiting for the processes the command left running; they were "
                    f"killed; log: {log_path}"
                )
        stopped = _stops.all_stopped(self._stop_dir)
        if code not in (EXIT_OK, EXIT_RESUMABLE) and stopped:
            how = f"signal {-code}" if code < 0 else f"exit {code}"
            self.say(f"  {stopped}; the launcher reported {how}: a stop")
            return EXIT_RESUMABLE
        return code

    def _check_stopped(self, at: int, hit: Target, log_path: str) -> None:
        """No step may be logged after a SIGKILL landed: one means a process of the job
        survived it (in a session or process group of its own) and trained on."""
        if self._killed_at is not None and at > self._killed_at:
            raise VerifyError(
                f"SIGKILL at {hit.moment} did not stop training: step {at} was logged after "
                f"the kill (at step {self._killed_at}); a process of the job survived it -- "
                f"started outside the launch's process tree and without its environment? "
                f"log: {log_path}"
            )

    def _signal(self, proc: Any, sig: int) -> None:
        """Signal every process of the launch, as a scheduler does; a SIGKILL is repeated
        until none is left, and the step logged by then is remembered (_check_stopped)."""
        tree = self._tree or _tree.Tree(proc.pid, "")
        if sig == signal.SIGKILL:
            tree.kill()
            self._killed_at = last_logged_step(self._live[1]) if self._live[1] else None
            return
        tree.send(sig, tree.members())

    def _reap(self, proc: Any) -> None:
        if proc.poll() is None or (self._tree is not None and self._tree.members()):
            self._signal(proc, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait()

    def _remaining(self) -> float | None:
        if self.aborted.is_set():
            return 0.0  # as a timeout: the launch is killed
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _finish(self, proc: Any, log: IO) -> int:
        try:
            while True:
                left = self._remaining()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(proc.args, 0)
                # Never an unbounded wait: the run beside may fail, and this one must stop then.
                wait = _TICK if left is None else min(_TICK, left)
                try:
                    return proc.wait(timeout=max(wait, 0.01))
                except subprocess.TimeoutExpired:
                    self._show()
        except subprocess.TimeoutExpired:
            self._reap(proc)
            raise VerifyError(f"timed out; the command was killed; log: {log.name}") from None
        finally:
            log.close()

    def _watch(
        self, proc: Any, run_dir: str, target: Target, save_steps: list[int]
    ) -> Target | None:
        """Wait for the target moment and signal the process group; returns the moment it hit
        (a save seen only once committed moves the target to the next save), or None if the
        process exited first."""
        probe = _StepProbe(run_dir)
        root = _layout.checkpoints_dir(run_dir)
        later = [s for s in save_steps if s > target.step]
        gap = _gap(save_steps)
        shown = time.monotonic()
        while proc.poll() is None:
            if time.monotonic() - shown >= _TICK:
                self._show()
                shown = time.monotonic()
            left = self._remaining()
            if left is not None and left <= 0:
                return None  # _finish reports the timeout
            if target.kind == "save":
                hit = os.path.isdir(os.path.join(root, _layout.tmp_name(target.step)))
                if not hit and os.path.isdir(os.path.join(root, _layout.step_name(target.step))):
                    if later:  # missed (a very short save): aim at the next one
                        target = Target("save", later.pop(0), target.signal)
                        continue
                    hit = True  # the last save: kill now, just after it
            else:
                hit = probe.last() >= target.step
            if hit:
                if proc.poll() is not None:
                    return None
                self._signal(proc, getattr(signal, "SIG" + target.signal))
                return target
            # Look for a save's directory in quick succession from two steps before it on.
            # Not earlier: on a machine with few cores the spin takes CPU from the training.
            near = target.kind == "save" and probe.last() >= target.step - min(gap, 2)
            time.sleep(_SPIN if near else _POLL)
        return None

    def _fail(self, what: str, code: int, log_path: str) -> None:
        tail = _tail(log_path)
        how = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
        raise ScriptFailedError(
            f"{what} {how} (0 = complete, {EXIT_RESUMABLE} = resumable); log: {log_path}\n"
            f"--- last lines ---\n{tail}",
            code,
            tail,
        )


def _gap(save_steps: list[int]) -> int:
    """The smallest distance between two saves (the first save's step if only one)."""
    gaps = [b - a for a, b in zip([0, *save_steps], save_steps, strict=False)]
    return min(gaps) if gaps else 1


def _exit_text(code: int, at: int, leftover: int | None) -> str:
    if code == EXIT_OK:
        return f"completed ({at} steps)"
    if code == EXIT_RESUMABLE:
        return f"saved and stopped at step {at} (exit 75)"
    name = signal.Signals(-code).name if code < 0 and -code in signal.valid_signals() else code
    text = f"killed ({name}) after step {at}"
    if leftover is not None:
        text += f", during the save of step {leftover}"
    return text


def _latest_committed(run_dir: str) -> int:
    found = _layout.scan(run_dir)
    return found[0][0] if found else 0


def _leftover_save(run_dir: str) -> int | None:
    """The step of a save a killed process left half-written, if any."""
    try:
        names = os.listdir(_layout.checkpoints_dir(run_dir))
    except FileNotFoundError:
        return None
    steps = [t[1] for t in map(_layout.transient, names) if t is not None and t[0] == "tmp"]
    return max(steps) if steps else None


def _tail(path: str, size: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class _StepProbe:
    """The last step logged in ``RUN/metrics.jsonl``, re-read only when the file changed."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._size = -1
        self._last = 0

    def last(self) -> int:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            # No metrics log (Run(metrics=False)): the newest checkpoint is the best we see.
            return _latest_committed(os.path.dirname(self.path))
        if size != self._size:
            self._size = size
            self._last = last_logged_step(os.path.dirname(self.path))
        return self._last
