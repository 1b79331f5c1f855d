"""The supervisor's decisions, as pure functions: how an attempt ended, and what comes next.

``classify(end) -> Verdict`` reads the facts of one attempt's end (exit status, the ranks' stop
markers, what the supervisor forwarded); ``policy(verdict, ...) -> Decision`` decides from the
verdict and the history of earlier attempts. Neither starts a process, sleeps or reads a file:
``unbroken run`` (:mod:`._supervisor`) gathers the facts and carries the decisions out, and the
tests check every row of both tables in milliseconds.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from ..process._exit import EXIT_FAILURE, EXIT_OK, EXIT_RESUMABLE

# Stop signals: the supervisor passes each on to the child and then relaunches nothing.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
# Signals a process brings on itself (a bad access, an abort, a bad instruction): a death by
# one is a failure of its own, which a relaunch meets again. Any other signal came from outside
# -- SIGKILL from the OOM killer, a user or a scheduler -- and says nothing about the script.
FAULTS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS}
)


class Outcome(enum.Enum):
    OK = "ok"
    """CMD finished (exit 0)."""
    RESUMABLE = "resumable"
    """Saved and stopped (exit 75, or every rank's stop marker), or stopped before it handled
    signals (nothing was training): relaunch and it continues."""
    CRASH = "crash"
    NOT_STARTED = "not-started"


class Action(enum.Enum):
    DONE = "done"
    RELAUNCH = "relaunch"
    RETRY = "retry"
    """Relaunch after a crash (after ``Decision.backoff_s``)."""
    REQUEUE = "requeue"
    """Under SLURM: ``scontrol requeue`` the job and exit 75."""
    STOP = "stop"
    """A stop signal reached the supervisor: relaunch nothing."""
    GIVE_UP = "give-up"


@dataclass(frozen=True)
class Failure:
    """What a crash was, when the process could tell: an uncaught exception (its type and the
    innermost frame of its traceback, from the record the trainer's ``sys.excepthook`` left;
    :func:`unbroken.process._stops.record_crash`) or a fault signal. Two crashes are the same
    failure when ``kind`` and ``where`` are equal; the message is only for the reader."""

    kind: str
    """The exception's type (``NameError``, ``torch.OutOfMemoryError``) or a signal's name."""
    where: str = ""
    """``FILE:LINE in FUNCTION`` of the innermost frame; empty for a signal."""
    message: str = ""

    def same(self, other: Failure | None) -> bool:
        return other is not None and (self.kind, self.where) == (other.kind, other.where)

    def __str__(self) -> str:
        text = f"{self.kind} at {self.where}" if self.where else f"killed by {self.kind}"
        return f"{text} ({self.message})" if self.message else text


@dataclass(frozen=True)
class End:
    """The facts of how one attempt ended."""

    returncode: int | None
    """As ``Popen.wait`` gives it (negative: killed by that signal); None: never started."""
    all_stopped: str | None = None
    """Every rank's stop marker is there ("2 of 2 ranks saved and stopped at step 6")."""
    unhandled_stop: bool = False
    """A forwarded stop signal reached only processes with no handler for it yet."""
    forwarded: bool = False
    """The supervisor forwarded a stop signal to this attempt."""
    failure: Failure | None = None
    """The uncaught exception the launch's processes recorded (every rank accounted for)."""


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    note: str = ""
    died: bool = False
    """The process did not save on its own way out (a crash, a death by signal): the newest
    in-memory snapshot is worth persisting."""
    failure: Failure | None = None
    """A crash's own failure, when known: compared with the previous crash's."""


def signame(signum: int | None) -> str:
    try:
        return signal.Signals(signum or 0).name
    except ValueError:
        return f"signal {signum}"  # real-time signals have no name in the enum


def classify(end: End) -> Verdict:
    rc = end.returncode
    if rc is None:
        return Verdict(Outcome.NOT_STARTED)
    if rc == EXIT_OK:
        return Verdict(Outcome.OK)
    if rc == EXIT_RESUMABLE:
        return Verdict(Outcome.RESUMABLE)
    if end.all_stopped is not None:
        # torchrun exits 1 when its ranks exit 75: the ranks' markers tell the truth.
        return Verdict(Outcome.RESUMABLE, f"{end.all_stopped}: resumable")
    if rc > 0 and end.unhandled_stop:
        # The stop reached ranks behind a launcher before they handled signals.
        return Verdict(
            Outcome.RESUMABLE, "stop signal before the ranks handled signals (start-up): resumable"
        )
    if rc == -signal.SIGTERM or (
        end.forwarded and rc < 0 and -rc in FORWARDED and -rc != signal.SIGHUP
    ):
        # Killed by a stop signal it had no handler for yet (still importing, or not a script
        # that handles signals): it was not training, nothing was lost.
        return Verdict(
            Outcome.RESUMABLE,
            f"{signame(-rc)} before CMD handled signals (start-up): resumable",
            died=True,
        )
    failure = end.failure
    if rc < 0:
        failure = Failure(signame(-rc)) if -rc in FAULTS else None
    return Verdict(Outcome.CRASH, died=True, failure=failure)


def advanced(began: int | None, newest: int | None) -> bool:
    """Whether an attempt made progress: it began where the run could resume from ``began``
    (None: nowhere, a fresh run) and left it resumable from ``newest``, at least two steps on.
    One step is not progress: every process takes a snapshot of its first step (that is how it
    times one), so a relaunch that dies of the same bug a step later would otherwise advance a
    step per crash and never be given up on."""
    if newest is None:
        return False
    return newest >= (began or 0) + 2


@dataclass(frozen=True)
class Limits:
    max_restarts: int = 100
    max_retries: int = 3
    backoff: float = 1.0
    max_backoff: float = 60.0
    reset_after: float = 600.0


@dataclass
class History:
    """What the policy remembers across attempts (updated by :func:`policy`)."""

    restarts: int = 0
    crashes: int = 0
    """Crashes in a row with no progress between them."""
    failure: Failure | None = None
    """The previous crash's failure, if it was known."""
    repeats: int = 0
    """Crashes in a row with that same failure, whatever their progress."""


@dataclass(frozen=True)
class Decision:
    action: Action
    exit_code: int = EXIT_OK
    """The supervisor's exit status, when the action ends supervision."""
    reason: str = ""
    backoff_s: float = 0.0
    crash: int = 0
    """The crash's place in the current run of crashes without progress."""


def policy(
    verdict: Verdict,
    history: History,
    limits: Limits,
    *,
    returncode: int | None,
    duration: float = 0.0,
    progressed: bool = False,
    stop_signal: int | None = None,
    requeue: bool = False,
) -> Decision:
    """What follows an attempt. ``progressed``: the run advanced during it (:func:`advanced`);
    ``stop_signal``: the first stop signal the
    supervisor got; ``requeue``: under SLURM with requeueing on."""
    out = verdict.outcome
    if out is Outcome.NOT_STARTED:
        return Decision(Action.GIVE_UP, EXIT_FAILURE, "could not start")
    if out is Outcome.OK:
        return Decision(Action.DONE, EXIT_OK, "finished")
    stopped_by = signame(stop_signal) if stop_signal is not None else ""
    if out is Outcome.RESUMABLE:
        history.crashes, history.failure, history.repeats = 0, None, 0
        if requeue:
            return Decision(Action.REQUEUE, EXIT_RESUMABLE)
        if stop_signal is not None:
            return Decision(Action.STOP, EXIT_RESUMABLE, f"stopped by {stopped_by}")
        if history.restarts >= limits.max_restarts:
            return Decision(
                Action.GIVE_UP,
                EXIT_RESUMABLE,
                f"restart limit reached (--max-restarts {limits.max_restarts})",
            )
        history.restarts += 1
        return Decision(Action.RELAUNCH, EXIT_RESUMABLE)
    code = returncode if returncode is not None and returncode > 0 else EXIT_FAILURE
    # A crash after progress (or after a long attempt) starts a new count: a run that advances
    # between crashes is never given up on, and is relaunched at once...
    long = duration > limits.reset_after
    fresh = progressed or long
    history.crashes = 1 if fresh else history.crashes + 1
    n = history.crashes
    # ...unless it fails the same way each time: the same exception at the same line (or the
    # same fault signal) is a bug, which no relaunch fixes, however far each one trains first.
    failure = verdict.failure
    same = failure is not None and not long and failure.same(history.failure)
    history.repeats = history.repeats + 1 if same else int(failure is not None)
    history.failure = failure
    if stop_signal is not None:
        return Decision(Action.STOP, code, f"stopped by {stopped_by} (CMD crashed)", crash=n)
    if failure is not None and history.repeats > limits.max_retries:
        return Decision(
            Action.GIVE_UP,
            code,
            f"gave up: the same failure {history.repeats} times in a row, {failure} -- a bug "
            f"to fix, not a fault to retry (--max-retries {limits.max_retries})",
            crash=n,
        )
    if n > limits.max_retries:
        last = f"; the last: {failure}" if failure is not None else ""
        return Decision(
            Action.GIVE_UP,
            code,
            f"gave up after {n} crashes in a row without progress (--max-retries "
            f"{limits.max_retries}){last}",
            crash=n,
        )
    if history.restarts >= limits.max_restarts:
        return Decision(
            Action.GIVE_UP,
            code,
            f"restart limit reached (--max-restarts {limits.max_restarts})",
            crash=n,
        )
    history.restarts += 1
    wait = 0.0 if progressed else min(limits.backoff * 2 ** (n - 1), limits.max_backoff)
    return Decision(Action.RETRY, code, backoff_s=wait, crash=n)
