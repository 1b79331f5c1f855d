"""Safe points: where a stop the signal handler recorded is honoured, and how the loop is driven.

The handler (:mod:`unbroken.process._signals`) only records a stop. ``Run`` honours it here, in its
own code, where the tracked state is that of a step boundary:

=========================  ==============================================================
safe point                 what happens on a recorded stop
=========================  ==============================================================
``Run()`` entry            (a stop before it) exit 75: nothing trained, nothing to save
end of ``Run()``           (a stop while resuming) release the lock, exit 75
``run.step()``             log the step, save it, exit 75 (every rank agrees first)
a loop's step / epoch      the step that ended is saved unless it is already, exit 75
start, a fetch from the
tracked loader between
steps
=========================  ==============================================================

Only ``run.step()`` acts when several ranks train: the others are local to one rank, which
must not leave the others waiting in a collective. A fetch inside a step (gradient
accumulation drew some of its micro-batches) is not a boundary: the stop waits for
``run.step()``. A completed run's final save ends a stop too: the process exits 0.

Misuse that would make a stop silently ignored is named where it shows (:func:`check_epoch`,
:class:`RepeatedStep`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ..errors import ConfigError
from ..process import _log, _signals
from ..process._signals import StopRequest
from ..state import Counters
from ._events import Events

log = _log.get("run")


class Run(Protocol):
    """What honouring a stop needs of :class:`unbroken.Run` (its own stop protocol: count,
    save, close, exit 75); declared here so that this module does not import ``_run``."""

    _stop: StopRequest
    _marks: tuple[int, int]
    _events: Events
    counters: Counters
    world_size: int
    stopped: bool

    @property
    def closed(self) -> bool: ...

    @property
    def last_saved_step(self) -> int | None: ...

    def _loader_marks(self) -> tuple[int, int]: ...

    def _loaders(self) -> list[Any]: ...

    def save(self, *, blocking: bool | None = None) -> str: ...

    def _halt(self, reason: str, *, saved: bool = True) -> bool: ...

    def close(self) -> None: ...


_FIX = (
    "call run.step(loss=...) once per optimizer step, after optimizer.step(); without it "
    "nothing is counted or saved, and a stop signal cannot be honoured"
)


def at_boundary(run: Run) -> bool:
    """No batch was drawn from the tracked loader since the last ``run.step()`` (or ``Run()``)."""
    return bool(run._loader_marks()[0] == run._marks[0])


def honour(run: Run, where: str, *, boundary: bool | None = None) -> None:
    """A safe point at ``where``: a requested stop saves what was trained since the last
    checkpoint and exits 75 (``run._halt``). Returns when there is no stop, when several
    ranks train (``run.step()`` agrees on stops), or inside a step."""
    stop = run._stop
    if not stop.requested or run.closed or run.stopped or run.world_size > 1:
        return
    if not (at_boundary(run) if boundary is None else boundary):
        return
    c = run.counters
    trained = c.step != (run.last_saved_step if run.last_saved_step is not None else 0)
    reason = f"signal {stop.name}"
    log.debug("unbroken: the stop is honoured at %s", where)
    if trained:
        run._events.record("stop", reason=reason)
        run.save(blocking=True)
    run._halt(reason, saved=trained)


def at_open(run: Run) -> None:
    """The end of ``Run()``: a stop recorded while resuming (or adopted from start-up) exits
    75 before any training, the lock released."""
    stop = run._stop
    if stop.signum is None or run.world_size > 1:
        return
    run.close()
    _signals.exit_not_training(stop.signum)


def fetch_hook(run: Run) -> Any:
    """The callback a loader calls before a fetch while a stop is requested."""

    def at_fetch(loader: Any) -> None:
        loaders = run._loaders()
        if loaders and loaders[0] is loader:
            honour(run, "a batch fetch")

    return at_fetch


# ---- misuse --------------------------------------------------------------------------------


def check_epoch(epoch: int, drawn: int, step_before: int, step_now: int) -> None:
    """At the end of an epoch: ``drawn`` batches came from its loader but ``run.step()`` was
    never called -- the run would train unsaved, deaf to stop signals. (An optimizer step may
    take several batches -- gradient accumulation inside or outside ``run.loop()`` -- but an
    epoch holds at least one step.)"""
    if drawn > 0 and step_now == step_before:
        raise ConfigError(
            f"epoch {epoch}: the loader yielded {drawn} batches but run.step() was never "
            f"called; {_FIX}"
        )


class RepeatedStep:
    """``run.step()`` twice without a new batch from the tracked loader counts one optimizer
    step twice (the loss logged twice, saves and the time budget off by one): warned once."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, step: int, tracked: bool, batches_now: int, batches_before: int) -> None:
        if self.warned or batches_now != batches_before or not tracked:
            return
        self.warned = True
        _log.event(
            log,
            logging.WARNING,
            "unbroken: run.step() was called at step %d without a new batch from the tracked "
            "loader since the last run.step(): each call counts one optimizer step; call it "
            "once per optimizer step, after the step's last micro-batch",
            step,
            step=step,
        )
