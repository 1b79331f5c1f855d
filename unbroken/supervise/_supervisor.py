"""The supervisor behind ``unbroken run``: launch, relaunch on exit 75, retry crashes, requeue.

The command itself (its options, its report) is ``cli/_run_cmd.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from ..process import _protocol, _shm, _stops
from ..process._exit import EXIT_FAILURE, EXIT_RESUMABLE
from . import _job, _persister, _policy, _standby

FORWARDED = _policy.FORWARDED
TAG = "unbroken run:"


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
    """This supervisor's private snapshot area (unbroken/process/_shm.py); None when snapshots are
    off -- asked for, or refused (say, another user owns /dev/shm/unbroken-<uid>): said once."""
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
    "step time, else as often as keeps them there (Run's snapshot_every), and says which; each "
    "is copied in the step (exact whatever the script writes next; Run's snapshot_copy="
    "'background' overlaps the copy with the next step and says what it cannot see); a "
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
