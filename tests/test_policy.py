"""The supervisor's decisions, table-tested in process (no process is started)."""

from __future__ import annotations

import signal

import pytest

from unbroken.cli._policy import (
    Action,
    End,
    History,
    Limits,
    Outcome,
    Verdict,
    classify,
    policy,
)

TERM, INT, USR1, HUP, KILL = (
    -signal.SIGTERM,
    -signal.SIGINT,
    -signal.SIGUSR1,
    -signal.SIGHUP,
    -signal.SIGKILL,
)


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
