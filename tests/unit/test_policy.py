"""The supervisor's decisions, table-tested in process (no process is started)."""

from __future__ import annotations

import signal

import pytest

from unbroken.supervise._policy import (
    Action,
    End,
    Failure,
    History,
    Limits,
    Outcome,
    Verdict,
    advanced,
    classify,
    policy,
)

TERM, INT, USR1, HUP, KILL, SEGV, BUS, ABRT = (
    -signal.SIGTERM,
    -signal.SIGINT,
    -signal.SIGUSR1,
    -signal.SIGHUP,
    -signal.SIGKILL,
    -signal.SIGSEGV,
    -signal.SIGBUS,
    -signal.SIGABRT,
)
BUG = Failure("NameError", "/work/train.py:42 in main", "name 'x' is not defined")
OTHER = Failure("NameError", "/work/train.py:57 in main", "name 'y' is not defined")


@pytest.mark.parametrize(
    "end, outcome, died, note",
    [
        (End(0), Outcome.OK, False, ""),
        (End(75), Outcome.RESUMABLE, False, ""),
        (End(None), Outcome.NOT_STARTED, False, ""),
        (End(1), Outcome.CRASH, True, ""),
        (End(KILL), Outcome.CRASH, True, ""),
        # torchrun exits 1 when its ranks exit 75: their markers decide
        (End(1, all_stopped="2 of 2 ranks saved and stopped"), Outcome.RESUMABLE, False, "2 of 2"),
        # a forwarded stop reached only ranks with no handler yet (start-up)
        (End(1, unhandled_stop=True), Outcome.RESUMABLE, False, "before the ranks handled"),
        # killed by SIGTERM before it handled signals: nothing was training
        (End(TERM), Outcome.RESUMABLE, True, "SIGTERM before CMD handled signals"),
        (End(INT, forwarded=True), Outcome.RESUMABLE, True, "SIGINT before"),
        (End(USR1, forwarded=True), Outcome.RESUMABLE, True, "SIGUSR1 before"),
        # not forwarded by the supervisor: someone else's SIGINT is a crash
        (End(INT), Outcome.CRASH, True, ""),
        # SIGHUP is not a stop a trainer handles
        (End(HUP, forwarded=True), Outcome.CRASH, True, ""),
        (End(KILL, forwarded=True), Outcome.CRASH, True, ""),
    ],
)
def test_classify(end: End, outcome: Outcome, died: bool, note: str) -> None:
    v = classify(end)
    assert (v.outcome, v.died) == (outcome, died)
    assert note in v.note


CRASH, OK, RESUMABLE = Verdict(Outcome.CRASH), Verdict(Outcome.OK), Verdict(Outcome.RESUMABLE)


def test_finished_and_resumable() -> None:
    h, lim = History(), Limits()
    assert policy(OK, h, lim, returncode=0).action is Action.DONE
    d = policy(RESUMABLE, h, lim, returncode=75)
    assert (d.action, h.restarts) == (Action.RELAUNCH, 1)
    assert policy(RESUMABLE, h, lim, returncode=75, requeue=True).action is Action.REQUEUE
    d = policy(RESUMABLE, h, lim, returncode=75, stop_signal=signal.SIGTERM)
    assert (d.action, d.exit_code, d.reason) == (Action.STOP, 75, "stopped by SIGTERM")


def test_crashes_without_progress_back_off_then_give_up() -> None:
    h, lim = History(), Limits(max_retries=3, backoff=1.0, max_backoff=3.0)
    waits = []
    for _ in range(3):
        d = policy(CRASH, h, lim, returncode=1)
        assert d.action is Action.RETRY
        waits.append(d.backoff_s)
    assert waits == [1.0, 2.0, 3.0]  # doubling, capped
    d = policy(CRASH, h, lim, returncode=1)
    assert (d.action, d.exit_code) == (Action.GIVE_UP, 1)
    assert "4 crashes in a row without progress (--max-retries 3)" in d.reason


def test_a_run_that_advances_between_crashes_is_never_given_up_and_not_kept_waiting() -> None:
    h, lim = History(), Limits(max_retries=3)
    for _ in range(10):
        d = policy(CRASH, h, lim, returncode=-9, progressed=True)
        assert (d.action, d.backoff_s, d.crash) == (Action.RETRY, 0.0, 1)
    assert h.restarts == 10


def test_a_resumable_stop_or_a_long_attempt_ends_a_run_of_crashes() -> None:
    h, lim = History(), Limits(max_retries=1, reset_after=60)
    policy(CRASH, h, lim, returncode=1)
    policy(RESUMABLE, h, lim, returncode=75)
    assert policy(CRASH, h, lim, returncode=1).action is Action.RETRY
    assert policy(CRASH, h, lim, returncode=1, duration=61).action is Action.RETRY
    assert policy(CRASH, h, lim, returncode=1).action is Action.GIVE_UP


def test_limits_and_stops_after_a_crash() -> None:
    h = History(restarts=5)
    d = policy(CRASH, h, Limits(max_restarts=5), returncode=3)
    assert (d.action, d.exit_code) == (Action.GIVE_UP, 3)
    assert "--max-restarts 5" in d.reason
    d = policy(RESUMABLE, History(restarts=5), Limits(max_restarts=5), returncode=75)
    assert (d.action, d.exit_code) == (Action.GIVE_UP, 75)
    d = policy(CRASH, History(), Limits(), returncode=-9, stop_signal=signal.SIGINT)
    assert (d.action, d.exit_code, d.reason) == (Action.STOP, 1, "stopped by SIGINT (CMD crashed)")
    d = policy(Verdict(Outcome.NOT_STARTED), History(), Limits(), returncode=None)
    assert (d.action, d.exit_code) == (Action.GIVE_UP, 1)


@pytest.mark.parametrize(
    "end, failure",
    [
        # the record the trainer's excepthook left: the failure, named
        (End(1, failure=BUG), BUG),
        # a death by a signal the process brought on itself: the signal is the failure
        (End(SEGV), Failure("SIGSEGV")),
        (End(BUS), Failure("SIGBUS")),
        (End(ABRT), Failure("SIGABRT")),
        # a SIGKILL comes from outside (the OOM killer, a user, a scheduler): no failure of
        # the script's own
        (End(KILL), None),
        (End(INT), None),
        (End(3), None),  # an exit code and no record: nothing to compare
        (End(0, failure=BUG), None),  # finished after all
        (End(75, failure=BUG), None),
    ],
)
def test_classify_names_the_failure(end: End, failure: Failure | None) -> None:
    assert classify(end).failure == failure


@pytest.mark.parametrize(
    "began, newest, progress",
    [
        (None, None, False),  # nothing to resume from
        (None, 1, False),  # a fresh run's first step only: the snapshot every process takes
        (None, 2, True),
        (10, None, False),
        (10, 9, False),
        (10, 10, False),
        (10, 11, False),  # a relaunch's first-step snapshot is not progress
        (10, 12, True),
        (10, 500, True),
    ],
)
def test_progress_is_more_than_a_relaunchs_first_step(
    began: int | None, newest: int | None, progress: bool
) -> None:
    assert advanced(began, newest) is progress


def test_the_same_failure_is_given_up_on_whatever_the_progress() -> None:
    """A bug: the same exception at the same line, four times in a row (the default
    --max-retries 3: four launches in all), each attempt having trained on -- given up, with
    the failure named, and the child's exit code."""
    h, lim = History(), Limits(max_retries=3)
    crash = Verdict(Outcome.CRASH, failure=BUG)
    for n in range(1, 4):
        d = policy(crash, h, lim, returncode=1, progressed=True)
        assert (d.action, d.crash) == (Action.RETRY, 1), n
    d = policy(crash, h, lim, returncode=1, progressed=True)
    assert (d.action, d.exit_code) == (Action.GIVE_UP, 1)
    assert "the same failure 4 times in a row" in d.reason
    assert "NameError at /work/train.py:42 in main" in d.reason
    assert "(--max-retries 3)" in d.reason


def test_another_failure_or_a_stop_starts_the_count_again() -> None:
    h, lim = History(), Limits(max_retries=2)
    crash, other = Verdict(Outcome.CRASH, failure=BUG), Verdict(Outcome.CRASH, failure=OTHER)
    for verdict in (crash, crash, other, other, crash, crash):
        d = policy(verdict, h, lim, returncode=1, progressed=True)
        assert d.action is Action.RETRY
    policy(RESUMABLE, h, lim, returncode=75)
    assert policy(crash, h, lim, returncode=1, progressed=True).action is Action.RETRY
    assert policy(crash, h, lim, returncode=1, progressed=True).action is Action.RETRY
    assert policy(crash, h, lim, returncode=1, progressed=True).action is Action.GIVE_UP
    # an unnamed crash in between breaks the row too
    h = History()
    for verdict in (crash, crash, CRASH, crash, crash):
        d = policy(verdict, h, lim, returncode=1, progressed=True)
        assert d.action is Action.RETRY


def test_the_same_failure_after_a_long_attempt_starts_the_count_again() -> None:
    """A failure that comes back only after hours of training each time is not the bug that
    kills every relaunch at once: --reset-after ends its run as it ends any run of crashes."""
    h, lim = History(), Limits(max_retries=1, reset_after=60)
    crash = Verdict(Outcome.CRASH, failure=BUG)
    for _ in range(5):
        d = policy(crash, h, lim, returncode=1, duration=61, progressed=True)
        assert d.action is Action.RETRY


def test_kills_from_outside_with_progress_are_never_given_up_on() -> None:
    """Ten SIGKILLs in a row, each after progress: no failure of the script's own, never given
    up. The same signal the process brought on itself (SIGSEGV) is a failure like a bug."""
    h, lim = History(), Limits(max_retries=3)
    for _ in range(10):
        d = policy(classify(End(KILL)), h, lim, returncode=-9, progressed=True)
        assert (d.action, d.backoff_s) == (Action.RETRY, 0.0)
    h = History()
    actions = [
        policy(classify(End(SEGV)), h, lim, returncode=-11, progressed=True).action
        for _ in range(4)
    ]
    assert actions == [Action.RETRY] * 3 + [Action.GIVE_UP]


def test_crashes_without_progress_name_the_last_failure() -> None:
    h, lim = History(), Limits(max_retries=1)
    policy(Verdict(Outcome.CRASH, failure=BUG), h, lim, returncode=1)
    d = policy(Verdict(Outcome.CRASH, failure=OTHER), h, lim, returncode=1)
    assert d.action is Action.GIVE_UP
    assert "2 crashes in a row without progress" in d.reason and "train.py:57" in d.reason
