"""``unbroken run``: supervise a training command -- relaunch on exit 75, retry crashes, requeue."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

from .. import _protocol, _shm, _stops
from .._exit import EXIT_FAILURE, EXIT_RESUMABLE, EXIT_USAGE
from . import _job, _persister, _policy, _standby

FORWARDED = _policy.FORWARDED
TAG = "unbroken run:"

DESCRIPTION = f"""Run CMD and keep it running until it finishes.

  exit 0            done; unbroken run exits 0
  exit 75           resumable (saved and stopped): relaunch at once; under SLURM,
                    `scontrol requeue` the job instead and exit 75
  killed by SIGTERM resumable too: CMD was stopped before it handled signals (while
                    importing, say), so nothing was training; also SIGINT/SIGUSR1
                    when the supervisor forwarded them
  anything else     a crash (non-zero exit or killed by a signal): relaunch after a
                    backoff (--backoff, doubling up to --max-backoff), at most
                    --max-retries times in a row; a crash run resets when an attempt
                    exits 75, made progress (two steps or more) or ran longer than
                    --reset-after seconds -- but the same failure (the same exception at
                    the same line, or the same fault signal) more than --max-retries times
                    in a row is a bug: given up on, and named, whatever the progress

Every relaunch counts toward --max-restarts. SIGTERM, SIGINT, SIGUSR1 and SIGHUP are
forwarded to CMD and every process under it that handles them -- under torchrun to every
rank, not to torchrun itself -- which should save and exit 75; after a stop signal nothing is
relaunched (under SLURM the job is still requeued). Ctrl-C is not forwarded a second time to
processes the terminal already delivered it to. CMD sees {_protocol.ATTEMPT}=<n> (1-based, per
supervisor) and {_protocol.SUPERVISED}=1.

Launchers (torchrun): when every rank saved and stopped, the attempt is resumable whatever
CMD's exit code (torchrun exits 1); each rank says so in {_protocol.STOP_DIR}. Processes CMD
leaves running (the ranks of a killed torchrun, still saving) are waited for, up to --grace
seconds, before anything is relaunched.

Warm standby (with snapshots; for `python SCRIPT`, `python -m MODULE` and `torchrun
--standalone`): once CMD opened its Run, a python with torch and unbroken imported starts
beside it and waits, before the script; it runs the script when CMD dies, without a process
start. Nothing of the script runs outside the process that trains. --standby deep: a second
CMD that runs the script up to its first Run() and waits there (its set-up saved too, but its
side effects happen twice, beside the trainer); --no-standby: off. Said at start-up.

SLURM (SLURM_JOB_ID set, --no-requeue not given): the job requeued is
${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}} for array jobs, else SLURM_JOB_ID; if
scontrol is missing or fails, the failure is reported and CMD is relaunched in place. In a
multi-node job (SLURM_JOB_NUM_NODES > 1) the job is requeued once per stop, by the first node
left to claim it (a file in the shared run directory, RUN/.unbroken.requeue-JOB.RESTART); the
others exit 75.
Use `exec unbroken run ...` in the batch script so `#SBATCH --signal=B:USR1@120` reaches it."""

EPILOG = """exit codes:
  0   CMD finished (exit 0)
  1   could not start CMD, or CMD's last crash was a death by signal
  2   usage error
  75  resumable: stopped by a signal, SLURM job requeued, or --max-restarts reached
  N   CMD's own exit code when it crashed and the retries ran out (or a stop came)

example: unbroken run --json report.json -- python train.py --config c.yaml"""

NUMERIC_OPTIONS: list[tuple[str, type[int] | type[float], float, str, str]] = [
    ("--max-restarts", int, 100, "N", "relaunches in total, resumable or crash (default 100)"),
    ("--max-retries", int, 3, "N", "crashes in a row that are retried (default 3)"),
    ("--backoff", float, 1.0, "SEC", "wait before a crash retry, doubling (default 1)"),
    ("--max-backoff", float, 60.0, "SEC", "longest wait before a crash retry (default 60)"),
    ("--reset-after", float, 600.0, "SEC", "an attempt this long ends a crash run (default 600)"),
]


@dataclass
class Attempt:
    attempt: int
    started: float  # Unix time, for correlating with training logs
    duration_s: float
    returncode: int | None  # None when killed by a signal or never started
    signal: str | None
    status: str  # ok | resumable | crash | not-started
    action: str  # done | relaunch | retry | requeue | stop | give-up
    crash: int = 0  # place in the current run of consecutive crashes
    backoff_s: float = 0.0
    signals: list[str] = field(default_factory=list)  # what the supervisor got, and did
    note: str = ""

    def line(self, max_retries: int) -> str:
        how = f"killed by {self.signal}" if self.signal else f"exit {self.returncode}"
        if self.status == "resumable":
            how += " (resumable)"
        elif self.status == "crash":
            how += " (crash)"
        elif self.status == "not-started":
            how = "could not start"
        act = self.action
        if act == "retry":
            act = f"retry {self.crash}/{max_retries} in {self.backoff_s:g}s"
        notes = "; ".join([*self.signals, self.note] if self.note else self.signals)
        note = f" [{notes}]" if notes else ""
        return f"attempt {self.attempt}: {_dur(self.duration_s)}, {how} -> {act}{note}"


def _dur(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}"


def _nonneg(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


def _signame(signum: int | None) -> str:
    try:
        return signal.Signals(signum or 0).name
    except ValueError:
        return f"signal {signum}"  # real-time signals have no name in the enum


def slurm_job_id(env: dict[str, str] | os._Environ[str]) -> str | None:
    """The id `scontrol requeue` needs: array jobs are addressed as ARRAYJOB_TASK."""
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


REQUEUE_CLAIM = ".unbroken.requeue-"
"""The claim of one stop's requeue in the (shared) run directory: ``<prefix><job>.<restart>``."""


def job_nodes(env: dict[str, str] | os._Environ[str]) -> tuple[int, int]:
    """(this task's node, the job's node count) of a SLURM job: (0, 1) when not told."""
    try:
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        node = int(env.get("SLURM_NODEID") or 0)
    except ValueError:
        return 0, 1
    return node, nodes


def claim_requeue(
    run_dir: str | None, job: str, env: dict[str, str] | os._Environ[str]
) -> tuple[bool, str, str]:
    """(whether this node's supervisor is the one to requeue the job after a stop; if not, who does;
    a note when the claim could not be made). One node: always this one. Several nodes (one
    supervisor per node): exactly one requeue per stop -- a second ``scontrol requeue`` of a
    requeued job fails, and a node that then relaunched in place would wait for a rendezvous that
    never comes -- and by whichever node is left, since the node that would requeue may be the node
    lost. The first supervisor to create ``<run dir>/.unbroken.requeue-<job>.<SLURM_RESTART_COUNT>``
    (O_CREAT|O_EXCL, atomic on a local or a cluster file system, NFSv3 included) requeues; the
    others exit 75. Without a run directory to claim in (no ``Run`` told one), or if the claim
    cannot be written, node 0 requeues, as before."""
    node, nodes = job_nodes(env)
    if nodes <= 1:
        return True, "", ""
    why = "no run directory told to claim the requeue in"
    if run_dir is not None:
        restart = env.get("SLURM_RESTART_COUNT") or "0"
        path = os.path.join(run_dir, f"{REQUEUE_CLAIM}{job}.{restart}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            return False, _claimant(path), ""
        except OSError as e:
            why = f"cannot claim the requeue in {run_dir}: {e.strerror or e}"
        else:
            try:
                claim = {"node": node, "host": socket.gethostname(), "pid": os.getpid()}
                os.write(fd, json.dumps({**claim, "time": time.time()}).encode())
            except OSError:
                pass  # the file is the claim; what it says is for the others' reports
            finally:
                os.close(fd)
            return True, "", ""
    return node == 0, "node 0", f"{why}: node 0 requeues"


def _claimant(path: str) -> str:
    """Who claimed the requeue, for the report: "node K (host)"."""
    try:
        with open(path, encoding="utf-8") as f:
            claim = json.loads(f.read(4096))
        return f"node {int(claim['node'])} ({claim['host']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another node"


class Supervisor:
    def __init__(self, args: argparse.Namespace, cmd: list[str]) -> None:
        self.a, self.cmd = args, cmd
        self.launch: _job.Launch | None = None
        self.stop: int | None = None  # the first stop signal received
        self.forwarded = False  # whether the current child already got the stop signal
        self.received: list[str] = []  # the current attempt's signals, for the report
        self.attempts: list[Attempt] = []
        self.tty: int | None = None
        # In-memory snapshots: the trainer writes them here; a crash loses at most one step.
        self.shm = _snapshot_area(args)
        self.area: str | None = None if self.shm is None else self.shm.path
        self.stops = _job.stop_area()  # where each launch's ranks say they saved and stopped
        self.told: str | None = None  # the run directory a launch told through its stop dir
        self.persister = _persister.Persister()
        self.standby = _standby.Standby(args, cmd, self.stops, self.shm, _say)  # next attempt

    # -- signals ------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No printing here: a handler that writes to stderr can re-enter its buffer.
        if self.stop is None:
            self.stop = signum
        self.received.append(self._forward(signum))

    def _forward(self, signum: int) -> str:
        name, launch = _signame(signum), self.launch
        if launch is None:
            return f"{name}: no child running"  # remembering the stop is enough
        self.forwarded = True
        # Not only to CMD: to every rank under a launcher (torchrun's are in sessions of their
        # own), as a scheduler signals the whole job; see _job.Launch.forward.
        return launch.forward(signum, self._terminal_pgrp(signum))

    def _terminal_pgrp(self, signum: int) -> int | None:
        # Ctrl-C reaches the terminal's whole foreground process group, child included; a
        # second copy from us would look like "press again to abort" to many trainers.
        if signum != signal.SIGINT or self.tty is None:
            return None
        try:
            return os.tcgetpgrp(self.tty)
        except OSError:
            return None

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> tuple[int, str]:
        """Launch CMD until the policy ends supervision; returns (exit code, outcome)."""
        a = self.a
        job = None if a.no_requeue else slurm_job_id(os.environ)
        limits = _policy.Limits(
            a.max_restarts, a.max_retries, a.backoff, a.max_backoff, a.reset_after
        )
        history = _policy.History()
        while True:
            began = self._newest_step(None)  # where the attempt resumes from (None: unknown)
            att, end = self._attempt()
            if end.returncode is None:
                return EXIT_FAILURE, att.note
            verdict = _policy.classify(end)
            att.status = verdict.outcome.value
            notes = [att.note, verdict.note]
            progressed = False
            if verdict.died:
                step, note = self._persist_snapshot()
                notes.append(note)
                progressed = _policy.advanced(began, self._newest_step(step))
            if verdict.failure is not None:
                notes.append(str(verdict.failure))
            att.note = "; ".join(filter(None, notes))
            decision = self._decide(verdict, history, limits, att, progressed, job)
            if decision.action is _policy.Action.REQUEUE:
                assert job is not None
                run_dir = (None if self.shm is None else self.shm.run_dir()) or self.told
                mine, who, why = claim_requeue(run_dir, job, os.environ)
                att.note = "; ".join(filter(None, [att.note, why]))
                if not mine:
                    att.action = f"stop ({who} requeues)"
                    node, nodes = job_nodes(os.environ)
                    return (
                        EXIT_RESUMABLE,
                        f"stopped; {who} requeues SLURM job {job} (node {node} of {nodes})",
                    )
                ok, why = _requeue(job)
                if ok:
                    att.action = f"requeue {job}"
                    return EXIT_RESUMABLE, f"requeued SLURM job {job}"
                # Requeue once failed will fail again: stay in place for the rest.
                att.note = "; ".join(filter(None, [att.note, f"scontrol failed: {why}"]))
                _say(f"scontrol requeue {job} failed ({why}); relaunching in place")
                job = None
                decision = self._decide(verdict, history, limits, att, progressed, job)
            if decision.action in (
                _policy.Action.DONE,
                _policy.Action.STOP,
                _policy.Action.GIVE_UP,
            ):
                return decision.exit_code, decision.reason
            if not a.quiet:
                _say(att.line(a.max_retries))
            if decision.action is _policy.Action.RETRY and not self._sleep(decision.backoff_s):
                att.action = "stop"
                return (
                    decision.exit_code,
                    f"stopped by {_signame(self.stop)} during backoff (CMD had crashed)",
                )

    def _decide(
        self,
        verdict: _policy.Verdict,
        history: _policy.History,
        limits: _policy.Limits,
        att: Attempt,
        progressed: bool,
        job: str | None,
    ) -> _policy.Decision:
        d = _policy.policy(
            verdict,
            history,
            limits,
            returncode=att.returncode if att.signal is None else -1,
            duration=att.duration_s,
            progressed=progressed,
            stop_signal=self.stop,
            requeue=job is not None,
        )
        att.action, att.crash, att.backoff_s = d.action.value, d.crash, d.backoff_s
        return d

    def _attempt(self) -> tuple[Attempt, _policy.End]:
        """Start CMD once and wait until it and what it left running are gone."""
        n = len(self.attempts) + 1
        env = _protocol.supervised_env(os.environ, attempt=n, snapshot_dir=self.area)
        t0, wall0, mark = time.monotonic(), time.time(), self.standby.mark()
        self.forwarded, self.received = False, []
        self.launch, adopted = self.standby.take(n)  # the warm standby, promoted (if any)
        try:
            self.launch = self.launch or _job.Launch(self.cmd, env, self.stops, n)
        except OSError as e:
            att = Attempt(n, wall0, 0.0, None, None, "not-started", "give-up")
            att.note = f"could not start {self.cmd[0]!r}: {e.strerror or e}"
            self.attempts.append(att)
            return att, _policy.End(None)
        if self.stop is not None and not self.forwarded:
            # The signal landed while Popen was forking, before the handler saw the child.
            # Its "no child running" entry is replaced by what happens now.
            self.received[-1:] = [self._forward(self.stop)]
        launch = self.launch
        rc = self.standby.wait(launch, n, mark, lambda: self.stop is not None)  # + its standby
        # What CMD left running (ranks of a killed launcher, still saving) is part of this
        # attempt: the next one must not start beside it. Signals still reach it meanwhile.
        stopped, left_note = launch.settle(rc, self.a.grace)
        self.launch = None
        told = os.path.join(launch.stop_dir, _stops.RUN_DIR_FILE)
        self.told = _shm.read_channel(told) or self.told
        dur = time.monotonic() - t0
        sig = _signame(-rc) if rc < 0 else None
        note = "; ".join(filter(None, [adopted, left_note]))
        att = Attempt(n, wall0, round(dur, 3), None if sig else rc, sig, "crash", "", note=note)
        att.signals = self.received  # the same list: later (between-attempt) ones land too
        self.attempts.append(att)
        end = _policy.End(
            rc, stopped, bool(launch.unhandled), self.forwarded, _failure(launch.stop_dir)
        )
        return att, end

    def _persist_snapshot(self) -> tuple[int | None, str]:
        """After a death: commit the trainer's newest in-memory snapshot durably, if it is
        newer than its last checkpoint -- in the persister process, which imported the store
        and torch at start-up (see :mod:`._persister`). Returns (its step, a note for the
        report)."""
        if self.shm is None or not self.shm.may_hold_snapshot():
            return None, ""
        try:
            self.shm.check()  # only its own area, into the run directory told
            run_dir = self.shm.run_dir()
            step = None if run_dir is None else self.persister.persist(self.shm.path, run_dir)
        except Exception as e:  # keep supervising: the durable checkpoints are still there
            _say(f"could not persist the in-memory snapshot: {e}")
            return None, f"snapshot not persisted: {e}"
        if step is None:
            return None, ""
        # Said once, in the attempt line.
        return step, f"kept the in-memory snapshot of step {step}"

    def _newest_step(self, persisted: int | None) -> int | None:
        """The newest step the run can resume from after a death: the snapshot just persisted,
        or the newest durable checkpoint in the run directory the trainer told (a crash right
        after a durable save persists nothing, and has made progress all the same)."""
        # Told through the snapshot area's channel, or (no area) the launch's stop directory.
        run_dir = (None if self.shm is None else self.shm.run_dir()) or self.told
        if run_dir is None:
            return persisted
        from ..store import _layout  # os and re only: no torch

        durable = max((s for s, _ in _layout.scan(run_dir)), default=None)
        known = [s for s in (persisted, durable) if s is not None]
        return max(known, default=None)

    def _sleep(self, seconds: float) -> bool:
        # Short naps: time.sleep resumes after a signal (PEP 475), so it cannot be woken.
        deadline = time.monotonic() + seconds
        while self.stop is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))
        return False


def _failure(stop_dir: str) -> _policy.Failure | None:
    """The uncaught exception the launch's processes recorded (:func:`_stops.failure`)."""
    crash = _stops.failure(stop_dir)
    if crash is None:
        return None
    where = f"{crash.get('file', '?')}:{crash.get('line', '?')}"
    if crash.get("function"):
        where += f" in {crash['function']}"
    return _policy.Failure(str(crash.get("type", "?")), where, str(crash.get("message", "")))


def _snapshot_area(args: argparse.Namespace) -> _shm.SupervisorArea | None:
    """This supervisor's private snapshot area (unbroken/_shm.py); None when snapshots are off
    -- asked for, or refused (say, another user owns /dev/shm/unbroken-<uid>): said once."""
    if args.no_snapshots:
        return None
    try:
        return _shm.SupervisorArea.create()
    except (_shm.Refused, OSError) as e:
        _say(f"in-memory snapshots are off, durable saves only: {e}")
        return None


def _requeue(job: str) -> tuple[bool, str]:
    try:
        r = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if r.returncode != 0:
        return False, f"exit {r.returncode}: {(r.stderr or r.stdout).strip()}"
    return True, ""


def _say(msg: str) -> None:
    print(f"{TAG} {msg}", file=sys.stderr, flush=True)


SNAPSHOTS_ON = (
    "in-memory snapshots: on -- the trainer takes one every step when that costs <= 1% of its "
    "step time, else as often as keeps them there (Run's snapshot_every), and says which; a "
    "crash (kill -9, OOM, segfault) redoes at most the steps since the last one"
)
SNAPSHOTS_OFF = (
    "in-memory snapshots: off (--no-snapshots) -- a crash loses the steps since the last "
    "durable save"
)


def startup(args: argparse.Namespace, sup: Supervisor) -> list[str]:
    """The supervisor's decisions, said once before the first launch (not with --quiet)."""
    lines = []
    if args.no_snapshots:
        lines.append(SNAPSHOTS_OFF)
    elif sup.shm is not None:
        lines.append(SNAPSHOTS_ON)  # (refused: said when the area was)
    lines.append(sup.standby.startup())
    return lines


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a training command; relaunch on exit 75, retry crashes, requeue on SLURM",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, kind, default, metavar, text in NUMERIC_OPTIONS:
        p.add_argument(flag, type=_nonneg(kind), default=default, metavar=metavar, help=text)
    p.add_argument(
        "--grace",
        type=_nonneg(float),
        default=300.0,
        metavar="SEC",
        help="after CMD fails, how long the processes it left running (ranks of a killed "
        "launcher, still saving) may take to stop before they are killed (default 300)",
    )
    p.add_argument("--no-requeue", action="store_true", help="under SLURM, relaunch in place")
    p.add_argument(
        "--no-snapshots",
        action="store_true",
        help="no in-memory snapshots (a crash then loses the steps since the last save)",
    )
    p.add_argument(
        "--standby",
        choices=_standby.DEPTHS,
        help="the warm standby, a process that takes over when the trainer dies with no process "
        "start on the way: 'imports' (the default) waits before the script with torch and "
        "unbroken imported, and nothing of the script runs before its turn (CMD must be python "
        "SCRIPT or python -m MODULE); 'deep' (formerly 'run') runs CMD up to the script's first "
        "Run() and waits there, its set-up done -- but what the script does before Run() "
        "happens twice, beside the trainer (files, downloads, memory, GPU memory); 'off'. See "
        "docs/supervise.md",
    )
    p.add_argument("--no-standby", action="store_true", help="the same as --standby off")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument(
        "cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to supervise"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]  # argparse keeps the separator in a REMAINDER argument
    if not cmd:
        print(
            "unbroken run: error: no command given (unbroken run [options] -- CMD ARGS...)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    sup = Supervisor(args, cmd)
    if not args.quiet:
        for line in startup(args, sup):
            _say(line)
    try:
        sup.tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        pass  # no controlling terminal: nothing can deliver Ctrl-C to the child but us
    old = {s: signal.signal(s, sup._on_signal) for s in FORWARDED}
    t0 = time.monotonic()
    if sup.shm is not None:
        sup.persister.start()  # imports the store while the first trainer starts
    if sup.shm is not None and _shm.any_stale():
        # Left by a supervisor that was killed itself: keep what it held, then free it.
        from ..store._snapshot import reap_stale

        for step, where in reap_stale():
            _say(f"kept the in-memory snapshot of step {step} left in {where}")
    try:
        code, outcome = sup.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if sup.tty is not None:
            os.close(sup.tty)
        if sup.launch is not None:
            sup.launch.kill()  # the supervisor failed itself: leave no rank behind
        sup.standby.close()
        sup.persister.close()
        if sup.shm is not None:
            sup.shm.discard()
        _job.discard(sup.stops)
    elapsed = time.monotonic() - t0
    restarts = max(len(sup.attempts) - 1, 0)
    if not args.quiet:
        _say(f"report for {shlex.join(cmd)}")
        for att in sup.attempts:
            _say("  " + att.line(args.max_retries))
    _say(
        f"{outcome}; exit {code} after {len(sup.attempts)} attempt(s), "
        f"{restarts} restart(s), {_dur(elapsed)}"
    )
    if args.json:
        report = {
            "command": cmd,
            "exit_code": code,
            "outcome": outcome,
            "restarts": restarts,
            "elapsed_s": round(elapsed, 3),
            "stop_signal": _signame(sup.stop) if sup.stop else None,
            "slurm_job": None if args.no_requeue else slurm_job_id(os.environ),
            "requeued": bool(sup.attempts) and sup.attempts[-1].action.startswith("requeue"),
            "attempts": [asdict(att) for att in sup.attempts],
        }
        tmp = f"{args.json}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.json)  # a reader never sees half a report
    return code
