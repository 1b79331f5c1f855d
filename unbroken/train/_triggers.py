"""When a step ends in a save, a stop, or neither: pure functions of counters, clock and flags.

Two phases, because ranks must agree: :func:`observe` reads what this rank sees (a stop
signal, its clock against the time budget, the time since the last save); the ``Run`` agrees
on those flags across ranks (one all-reduce, MAX); :func:`decide` then turns the agreed flags
and the step count into what every rank does. Step-count triggers are deterministic, so they
need no agreement. Nothing here touches a process group, a file or a clock of its own: the
tests call these with made-up values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ._config import RunConfig


@dataclass(frozen=True)
class Clock:
    """What the time triggers look at (``time.time()`` scale, seconds)."""

    now: float
    last_save: float
    """When the last save (or the run's start) happened."""
    step_seconds: float | None = None
    """A cautious estimate of one step (a decaying maximum)."""
    save_seconds: float | None = None
    """How long the last complete save took."""
    deadline: float | None = None
    """By when the process must have saved and exited (``time_limit``, SLURM's end time)."""


@dataclass(frozen=True)
class Seen:
    """One rank's view at the end of a step; agreed on by every rank before :func:`decide`."""

    signalled: bool = False
    out_of_time: bool = False
    minutes_due: bool = False


NOTHING = Seen()
"""What :func:`observe` sees without a time budget, timed saves or a signal."""
SIGNALLED = Seen(signalled=True)
"""What it sees then with a signal."""


@dataclass(frozen=True)
class Decision:
    save: bool = False
    final: bool = False
    """This step completes the run (``max_steps``): the save is the final checkpoint."""
    stop: str | None = None
    """Why the run stops after saving (a signal, the time limit); None: it goes on."""


SAVE = Decision(save=True)
GO_ON = Decision()


def step_due(config: RunConfig, step: int) -> bool:
    """``save_every`` asks for a save at this step."""
    every = config.save_every
    return bool(every and step % every == 0)


def observe(config: RunConfig, clock: Clock, signalled: bool) -> Seen:
    """This rank's flags: a stop signal, the time budget about to run out (a step and a save
    must still fit, plus ``time_margin``), a timed save due."""
    out_of_time = False
    if clock.deadline is not None:
        need = (clock.step_seconds or 0.0) + (clock.save_seconds or 0.0)
        out_of_time = clock.now + need + config.time_margin >= clock.deadline
    minutes = config.save_every_minutes
    due = minutes is not None and clock.now - clock.last_save >= minutes * 60
    return Seen(signalled=signalled, out_of_time=out_of_time, minutes_due=due)


def decide(
    config: RunConfig,
    step: int,
    seen: Seen,
    *,
    complete: bool,
    epoch_save_pending: bool = False,
    signal_name: str = "",
) -> Decision:
    """What the step that just ended leads to. ``complete``: training is done after it
    (``max_steps`` reached or the run already complete)."""
    stop = None
    if seen.signalled:
        stop = f"signal {signal_name or 'on another rank'}"
    elif seen.out_of_time:
        stop = "time limit"
    save = stop is not None or seen.minutes_due or epoch_save_pending
    save = save or step_due(config, step)
    final = complete and config.save_final
    if final:
        stop = None  # the final save ends the run: exit 0, whatever signals came
    return Decision(save=save or final, final=final, stop=stop)


def next_save_text(config: RunConfig, step: int, clock: Clock) -> str:
    """What a progress bar can predict: "next save in 12 steps, 4.5 min", and when the time
    limit will stop (and save) the run."""
    parts = []
    left_in_run = None if config.max_steps is None else config.max_steps - step
    if left_in_run is not None and left_in_run <= 0:
        return ""  # complete: the final save is being written, no other follows
    if config.save_every:
        left = config.save_every - step % config.save_every
        if left_in_run is not None and config.save_final:
            left = min(left, left_in_run)  # the final save comes first
        parts.append(f"{left} step{'' if left == 1 else 's'}")
    if config.save_every_minutes is not None:
        minutes = config.save_every_minutes * 60 - (clock.now - clock.last_save)
        parts.append(f"{max(0.0, minutes) / 60:.1f} min")
    text = f"next save in {', '.join(parts)}" if parts else ""
    if clock.deadline is not None:
        left_s = clock.deadline - config.time_margin - clock.now
        text += f"{'; ' if text else ''}stop and save in {max(0.0, left_s) / 60:.1f} min"
    return text


class Pace:
    """How long steps take: the wall time since the previous step ended, minus saves and
    snapshots (:meth:`exclude`), and a cautious estimate of the next (a decaying maximum)."""

    __slots__ = ("estimate", "last")

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.estimate: float | None = None

    def tick(self) -> float:
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        e = self.estimate
        if e is None:
            self.estimate = dt
        else:  # max(0.8 * e, dt), without the call
            e *= 0.8
            self.estimate = e if e >= dt else dt
        return dt

    def exclude(self, seconds: float) -> None:
        """Time spent saving is not a training step."""
        self.last += seconds
