"""The run: a few lines added to a plain PyTorch loop make it resume exactly.

Order of events (the contract; docs/resume.md repeats it)::

    Run(...)                    lock the run dir, clean a killed save's leftovers,
                                load the latest valid checkpoint into every component
                                (loaders first store their position; RNG streams last)
    for epoch in run.epochs(E): (or: for batch in run.loop(loader))
        for batch in loader:
            ... forward, backward, optimizer.step(), scheduler.step(), ema.update()
            run.step(loss=loss) count the step, log it, then save if a trigger fired;
                                on a signal or the time budget: save, exit 75
        <epoch end>             count the epoch; save if save_on_epoch_end
    <end of epochs()/loop()>    finish(): final save, release the lock

``Run`` is a facade: it owns the components (a :class:`~unbroken.state.Registry`), the
counters and the options, and calls its collaborators in the order above. Each collaborator
gets what it works on, never the run:

``Events`` (logs, hooks), ``Checkpointer`` (lock, saves, retention, snapshots, the remote
tier), ``Resumer`` (which checkpoint, loading it), ``ModelSwap``, ``Audit``, ``Stepper``
(``run.loop()``'s step starts), and the pure ``_triggers`` and ``_stopping``. docs/design.md
has the table.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import _dist
from ..data._contract import is_loader
from ..errors import ConfigError
from ..process import _quick_exit, _signals, _stops
from ..process._exit import EXIT_RESUMABLE
from ..process._protocol import ProcessContext
from ..process._signals import StopRequest, install_signal_handlers, process_start
from ..state import Counters
from . import _as_standby, _metrics, _triggers
from ._audit import Audit
from ._checkpointer import Checkpointer
from ._components import remote_retention, retention, track
from ._config import RunConfig, deadline, split_arguments
from ._determinism import warn_determinism
from ._events import Events
from ._loop import Stepper
from ._progress import Progress, steps_for_epochs
from ._resume import Resumer
from ._staging import ModelSwap
from ._stopping import RepeatedStep, at_open, check_epoch, fetch_hook, honour

_TENSOR, _FLOAT32 = torch.Tensor, torch.float32


class Run:
    """Track the components of a training run; resume them exactly; save them safely.

    Components are keyword arguments: modules, optimizers, LR schedulers, GradScalers,
    :class:`unbroken.EMA`, :class:`unbroken.MapLoader`, random generators and any object with
    ``state_dict``/``load_state_dict``; ``components={...}`` takes any names, options' too.
    Options: a :class:`RunConfig` as ``config=``, or its fields as keywords (not both)::

        run = unbroken.Run("runs/x", model=model, optimizer=opt, scheduler=sched,
                           loader=loader, save_every=100)
        for epoch in run.epochs(10):
            for x, y in loader:
                ...
                run.step(loss=loss)
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        /,
        *,
        config: RunConfig | None = None,
        components: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        _as_standby.wait_for_turn()  # a warm standby waits here: before the lock and any read
        self.config, kwargs = split_arguments(config, components, kwargs)
        cfg = self.config
        self.dir = os.path.abspath(os.fspath(run_dir))
        self.rank, self.world_size = _dist.rank(), _dist.world_size()
        _dist.clean_exit()  # several ranks: exit with our status, never the backend's abort
        _dist.start_liveness()  # a dead peer ends unbroken's waits for it (_dist._Liveness)
        _dist.watch(True)  # ... and, from here to close(), a wait in anyone's collective
        self.counters = Counters(stage=cfg.stage)
        self.registry = track(kwargs, self.counters, cfg, self.rank, self.world_size)
        self._found_loaders: tuple[int, list[Any]] = (-1, [])
        warn_determinism()  # on CUDA: the settings that make a bitwise resume impossible
        process = ProcessContext.read()
        self._watched = process.run_dir is not None  # `unbroken verify` watches the log
        self._events = Events(self.dir, self.counters, on_save=cfg.on_save, on_resume=cfg.on_resume)
        self._checkpointer = Checkpointer(
            self.dir,
            retention(cfg, process, self.rank),
            self._events,
            rank=self.rank,
            snapshot_dir=process.snapshot_dir,
            snapshot_every=cfg.snapshot_every,
            snapshot_copy=cfg.snapshot_copy,
            remote=cfg.remote,
            remote_retention=remote_retention(cfg, process),
            remote_timeout=cfg.remote_finish_timeout,
            schedule={"max_steps": cfg.max_steps, "save_every": cfg.save_every},
        )
        self.store = self._checkpointer.store
        self._swap = ModelSwap(
            self.registry,
            self.counters,
            grow=cfg.grow,
            optimizer_factory=cfg.optimizer_factory,
            wrap_model=cfg.wrap_model,
            on_changed=self._events.model_changed,
        )
        self._stop = StopRequest()
        self._progress: Progress | None = None
        self._closed = False
        self.stopped = False
        self.resumed_from: int | None = None
        self._open()
        self._audit = Audit(
            self.registry,
            resumed=self.resumed_from is not None,
            record=self._events.audit,
            closed=lambda: self._closed,
        )
        self._stepper = Stepper(self.registry, self.counters, cfg, self._audit, self._swap, self)

    # ---- start-up -----------------------------------------------------------------------------

    def _open(self) -> None:
        cfg = self.config
        if self.world_size == 1:
            _signals.honour_pending()  # a stop before Run(): nothing trained yet, exit 75 now
        _signals.run_opening()
        if cfg.handle_signals:
            # From now to exit; until training starts a stop exits 75 (resuming is not training).
            install_signal_handlers()
        self._checkpointer.open()
        if self._checkpointer.snapshots is not None:
            self._checkpointer.snapshots.track(c.obj for c in self.registry)
        try:
            resumer = Resumer(
                self.store,
                cfg,
                self.registry,
                self.counters,
                self.rank,
                self.world_size,
                self._checkpointer.snapshots,
                self._swap,
                self._checkpointer.remote_tier,
            )
            self.resumed_from = resumer.resume()
            if self.rank == 0 and cfg.metrics:
                # A metrics log that cannot be opened (a planted symlink, a FIFO, a full
                # disk) fails the start like a checkpoint would: the lock is released.
                self._events.open_metrics(
                    self.counters.metrics_offset, self.resumed_from, every_step=self._watched
                )
            if self.resumed_from is not None:
                self._events.resumed(self.resumed_from, self._path(self.resumed_from))
            if resumer.extended_to is not None:
                self._events.extended(resumer.extended_to)
        except BaseException:
            self.close()
            raise
        self._checkpointer.start(
            world_size=self.world_size, async_save=cfg.async_save, resumed_from=self.resumed_from
        )
        self._marks = self._loader_marks()
        self._epoch_save_pending = False
        self._pace = _triggers.Pace()
        # A background saver (async_save) or in-memory snapshots: both are set up by now and
        # never later (a snapshot is only taken in an area, which is only made at the start).
        ckpt = self._checkpointer
        self._background = ckpt.background is not None or not ckpt.snapshots_idle
        # The budget is the process's: counted from its start, imports and resume included.
        self._deadline = deadline(process_start(), cfg)
        self._repeated = RepeatedStep()
        # With handle_signals=False, handlers installed already (the supervisor's) still count.
        self._stop.install(handlers=cfg.handle_signals)
        self._stop.at_fetch = fetch_hook(self)
        at_open(self)  # a stop while resuming: nothing trained, exit 75
        show = sys.stderr.isatty() if cfg.progress is None else cfg.progress
        if show and self.rank == 0:
            self._progress = Progress(cfg.max_steps, self.counters.step)

    # ---- the loop -----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Training is complete (``max_steps`` reached or ``finish()`` called)."""
        c, m = self.counters, self.config.max_steps
        return c.complete or (m is not None and c.step >= m)

    def step(self, loss: Any = None, **scalars: Any) -> bool:
        """Mark the end of one optimizer step; log, save, stop as configured.

        Returns True when the loop should end (complete, or stopped with ``exit_on_stop=False``).
        """
        c, cfg, ckpt = self.counters, self.config, self._checkpointer
        _dist.stepped()  # the watchdog's mark: this rank is not stuck
        # Without a background saver or snapshots (fixed at the start) there is nothing to
        # raise or wait for, now or later: the step skips these calls.
        snapshots = False
        if self._background:
            ckpt.check()  # a background save that failed is raised at the next step
            # The previous step's in-memory snapshot committed before this step is logged: a
            # step the log shows is never more than one step past the newest snapshot.
            snapshots = not ckpt.snapshots_idle
            if snapshots:
                self._pace.exclude(ckpt.snapshot_committed())
        c.step += 1
        c.train_seconds += self._pace.tick()
        found = self._found_loaders  # (self._loaders(), without the call)
        loaders = found[1] if found[0] == self.registry.version else self._loaders()
        marks = (loaders[0].yielded_batches, loaders[0].yielded_samples) if loaders else (0, 0)
        if marks[0] == self._marks[0]:  # (only then can it warn)
            self._repeated.check(c.step, bool(loaders), marks[0], self._marks[0])
        c.samples += marks[1] - self._marks[1]
        self._marks = marks
        signalled = self._stop.signum is not None
        # The clock is read only when something looks at it: a time budget, timed saves, the
        # progress bar. Without those, observe() sees the signal alone.
        timed = self._deadline is not None or cfg.save_every_minutes is not None
        clock = self._clock() if timed or self._progress is not None else None
        if timed:
            assert clock is not None
            seen = _triggers.observe(cfg, clock, signalled)
        else:
            seen = _triggers.SIGNALLED if signalled else _triggers.NOTHING
        if type(loss) is _TENSOR and loss.dtype is _FLOAT32 and loss.is_cpu:
            # The common loss, read at once: .detach().float() of a float32 tensor holds the
            # same values (float() returns it as it is), so .item() gives the same float, bit
            # for bit, without the two new tensors (_loss_value's other cases).
            loss = loss.item() if loss.numel() == 1 else loss.detach().mean().item()
        elif isinstance(loss, torch.Tensor):
            loss = self._loss_value(loss)
        if self.world_size > 1:
            seen, loss = self._agree(seen, loss)
        record: dict[str, Any] = {"step": c.step, "epoch": c.epoch}
        if loss is not None:
            record["loss"] = loss
        if scalars:
            record.update(_held(scalars))
        metrics = self._events.metrics  # (Events.log_step, without the call)
        if metrics is not None:
            metrics.step(record)
        if self._progress is not None:
            assert clock is not None
            self._progress.update(c.step, loss, _triggers.next_save_text(cfg, c.step, clock))
        m = cfg.max_steps
        complete = c.complete or (m is not None and c.step >= m)  # self.done
        if complete or self._epoch_save_pending or seen is not _triggers.NOTHING:
            decision = _triggers.decide(
                cfg,
                c.step,
                seen,
                complete=complete,
                epoch_save_pending=self._epoch_save_pending,
                signal_name=self._stop.name,
            )
        else:  # what decide() returns then: a save only if save_every says so (step_due)
            every = cfg.save_every
            decision = _triggers.SAVE if every and c.step % every == 0 else _triggers.GO_ON
        self._epoch_save_pending = False
        stop = decision.stop
        if decision.final:
            c.complete = True
        if stop is not None:
            # Logged before the save: the checkpoint's log length includes it, a resume keeps it.
            self._events.record("stop", reason=stop)
        if decision.save:
            # A stop's checkpoint must be committed before the process exits.
            self.save(blocking=stop is not None)
        elif snapshots:
            self._pace.exclude(
                ckpt.after_step(c.step, False, self._snapshot_state, self._pace.estimate)
            )
        if stop is not None:
            return self._halt(stop)
        return c.complete or (m is not None and c.step >= m)  # self.done

    def _clock(self) -> _triggers.Clock:
        return _triggers.Clock(
            now=time.time(),
            last_save=self._checkpointer.last_save_wall,
            step_seconds=self._pace.estimate,
            save_seconds=self._checkpointer.last_save_seconds,
            deadline=self._deadline,
        )

    def _agree(self, seen: _triggers.Seen, loss: Any) -> tuple[_triggers.Seen, Any]:
        """The triggers' flags and the logged loss (a number: :meth:`_loss_value`), agreed on
        by every rank.

        Each rank may see a signal or a clock the others do not; one all-reduce makes every
        rank stop and save at the same step (no rank left waiting in a collective). The logged
        loss is the mean over ranks.
        """
        if self.world_size == 1:
            return seen, loss
        flags = [float(seen.signalled), float(seen.out_of_time), float(seen.minutes_due)]
        total = _dist.sum_floats([*flags, float(loss) if loss is not None else 0.0])
        mean = total[3] / self.world_size if loss is not None else None
        return _triggers.Seen(total[0] > 0, total[1] > 0, total[2] > 0), mean

    def _loss_value(self, loss: torch.Tensor) -> Any:
        """The loss to log: a float (the mean of its elements, in float32), or, for a loss on
        a device that is only logged, a new one-element tensor that the metrics log reads when
        it writes the line (``.item()`` now would wait for the device every step). Read now
        when shown, averaged over ranks, or on the CPU (nothing to wait for)."""
        t = loss.detach().float()
        if self._progress is not None or self.world_size > 1 or t.device.type == "cpu":
            return (t if t.numel() == 1 else t.mean()).item()
        if self._events.metrics is None:
            return loss  # neither logged nor shown: never read
        # mean() of one element is that element, bit for bit; it is a copy, so the caller
        # changing its loss in place later does not change what is logged.
        return t.mean()

    def _loader_marks(self) -> tuple[int, int]:
        """(batches, samples) yielded so far by the first tracked loader (the training one)."""
        loaders = self._loaders()
        if not loaders:
            return (0, 0)
        return (loaders[0].yielded_batches, loaders[0].yielded_samples)

    def _halt(self, reason: str, *, saved: bool = True) -> bool:
        self.stopped = True
        self.close()
        if self.config.exit_on_stop:
            self._events.stopped(reason, saved=saved)
            _stops.record(self.counters.step, reason, self.rank, self.world_size)  # for launchers
            _quick_exit.arm()
            raise SystemExit(EXIT_RESUMABLE)  # every rank stops at this step (_dist.clean_exit)
        return True

    def stop(self, reason: str) -> None:
        """Stop now, for a framework whose own loop caught the stop signal: save this step
        (unless saved already), close the run and say so (the stop message). The caller exits
        (with 75, :data:`unbroken.EXIT_RESUMABLE`)."""
        if self._closed:
            return
        if self._checkpointer.last_saved_step != self.counters.step:
            self.save(blocking=True)
        self.stopped = True
        self.close()
        self._events.stopped(reason)
        _quick_exit.arm()

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Epoch numbers from the one in progress to ``num_epochs - 1``; then ``finish()``."""
        if self.config.before_step is not None or self.config.settings is not None:
            raise ConfigError(
                "settings and before_step are applied at step starts, which only run.loop() "
                "sees; use `for batch in run.loop(loader)` (with epochs= if you count epochs)"
            )
        self._audit.loop_started()
        loaders = self._loaders()
        first = loaders[0] if loaders else None
        if self._progress is not None and self.config.max_steps is None:
            self._progress.set_total(steps_for_epochs(first, self.counters, num_epochs))
        if self.counters.complete and self.counters.epoch < num_epochs:
            if self.config.max_steps is None:
                # A finished run asked for more epochs: it continues, and says so.
                self.counters.complete = False
                self._events.extended(f"{num_epochs} epochs")
        while self.counters.epoch < num_epochs and not self.done:
            epoch = self.counters.epoch
            for loader in loaders:
                if callable(getattr(loader, "set_epoch", None)):
                    loader.set_epoch(epoch)
            honour(self, f"the start of epoch {epoch}")
            # A whole epoch must hold a step (one resumed mid-way may end inside a step).
            whole = first is None or getattr(first, "position", 0) == 0
            if self.config.on_epoch_start is not None and whole:
                self._stepper.begin_step(first)
            before = (self._loader_marks()[0], self.counters.step)
            yield epoch
            if self.done or self.stopped:
                break
            drawn = (self._loader_marks()[0] - before[0]) * whole
            check_epoch(epoch, drawn, before[1], self.counters.step)
            self._end_epoch(epoch + 1, epoch + 1 >= num_epochs)
        if not self.stopped:
            self.finish()

    def loop(self, loader: Iterable[Any], *, epochs: int | None = None) -> Iterator[Any]:
        """Batches across epochs until ``max_steps`` (or ``epochs``), then ``finish()``."""
        if self.config.max_steps is None and epochs is None:
            raise ConfigError("loop() needs max_steps (a Run option) or epochs=")
        yield from self._stepper.loop(
            loader,
            epochs,
            end_epoch=self._end_epoch,
            halted=lambda: self.done or self.stopped,
            safe_point=lambda where: honour(self, where),
        )
        if not self.stopped:
            self.finish()

    def _end_epoch(self, next_epoch: int, last: bool = False) -> None:
        self.counters.epoch = next_epoch
        if not self.config.save_on_epoch_end or self.done:
            return
        if last and self.config.save_final:
            return  # finish() saves this step as the final checkpoint; do not write it twice
        if self._loader_marks()[0] != self._marks[0]:
            # Batches were drawn since the last step: a gradient-accumulation window spans the
            # epoch boundary. Saving now would lose it; save at the end of this step instead.
            self._epoch_save_pending = True
        else:
            self.save()

    def _loaders(self) -> list[Any]:
        """Tracked loaders: components meeting unbroken.data.Loader (or tagged kind="loader").
        Asked twice a step and a protocol check costs microseconds: kept per registry version."""
        if self._found_loaders[0] != self.registry.version:
            found = [c.obj for c in self.registry if is_loader(c.obj)]
            self._found_loaders = (self.registry.version, found)
        return self._found_loaders[1]

    # ---- what the loop exposes ----------------------------------------------------------------

    @property
    def settings(self) -> Any:
        """The settings' values for the current step (``run.settings.lr``, ...)."""
        return self._stepper.values

    @property
    def accumulating(self) -> bool:
        """In ``run.loop()`` with ``grad_accum`` > 1: more micro-batches follow in this step."""
        return self._stepper.accumulating

    @property
    def model(self) -> Any:
        """The tracked model (the new one after a callback changed it)."""
        return self._stepper.model()

    @property
    def optimizer(self) -> Any:
        """The tracked optimizer (rebuilt after a model change)."""
        return self._stepper.optimizer()

    @property
    def ema(self) -> Any:
        return self._stepper.ema()

    @property
    def stage(self) -> Any:
        return self.counters.stage

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint this process saved or resumed from."""
        return self._checkpointer.last_saved_step

    @property
    def last_save_seconds(self) -> float | None:
        """How long the last save took (blocking part and background part together)."""
        return self._checkpointer.last_save_seconds

    # ---- saving -------------------------------------------------------------------------------

    def save(self, *, blocking: bool | None = None) -> str:
        """Save every component now (collective); returns the checkpoint's path.

        With ``async_save=True`` (and ``blocking`` not True) only the snapshot blocks; writing
        and committing finish in the background (see :class:`unbroken.store.AsyncSaver`).
        """
        t0 = time.perf_counter()
        self._checkpointer.check_lock()
        payload, meta = self._state(durable=True)
        path = self._checkpointer.save(self.counters.step, payload, meta, blocking=bool(blocking))
        self._pace.exclude(time.perf_counter() - t0)
        return path

    def _state(self, durable: bool) -> tuple[Any, dict[str, Any]]:
        """(payload, meta) of every component now; the metrics log's length goes with it
        (fsynced first for a durable checkpoint)."""
        c = self.counters
        c.metrics_offset = self._events.metrics_offset(durable)
        meta = {"epoch": c.epoch, "samples": c.samples, "stage": c.stage}
        if self._events.metrics is not None:
            meta["metrics_bytes"] = c.metrics_offset  # the log that travels with it (remote=)
        return self.registry.collect(self.rank), meta

    def _snapshot_state(self) -> tuple[Any, dict[str, Any]]:
        return self._state(durable=False)

    def _path(self, step: int) -> str:
        return self._checkpointer.path(step)

    def wait(self) -> None:
        """Wait for a background save to commit; raise its error if it failed."""
        self._checkpointer.wait()

    def finish(self) -> None:
        """Mark training complete, save a final checkpoint (if configured) and close."""
        if self._closed:
            return
        c = self.counters
        if self.config.save_final and not (c.complete and self.last_saved_step == c.step):
            c.complete = True
            self.save(blocking=True)
        c.complete = True
        self.wait()
        self._checkpointer.finishing()  # remote=: what follows waits remote_finish_timeout at most
        self.close()
        self._checkpointer.wait_durable()  # remote=: exit 0 only once the store has it

    def install_signal_handlers(self) -> None:
        """Install the stop handlers again, on top of any a framework installed since
        ``Run()`` (Lightning does, in ``fit``): ours record the stop, then call theirs. A stop
        recorded before is honoured now if nothing trained since the last save."""
        self._stop.install()
        honour(self, "the start of training")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the lock and close the metrics log. The signal handlers stay until the
        process exits: a stop signal from now on exits 75 (nothing is training)."""
        if self._closed:
            return
        self._closed = True
        try:
            # The lock is released only after a save in flight committed (or failed).
            self._checkpointer.wait()
            self._checkpointer.close_remote()
        finally:
            _dist.watch(False)  # what the script does after training is its own
            self._stop.uninstall()
            if self._progress is not None:
                self._progress.close()
            self._events.close()
            self._checkpointer.release()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
            return
        try:
            self.close()
        except Exception as e:  # do not hide the exception that ended the block
            self._events.close_failed(e)

    def __repr__(self) -> str:
        return (
            f"Run({self.dir!r}, step={self.counters.step}, epoch={self.counters.epoch}, "
            f"components={self.registry.names()})"
        )


def _held(scalars: dict[str, Any]) -> dict[str, Any]:
    """The user's values as they are now: the metrics log reads them at its next flush, so a
    tensor or array that changes in place must be read (on the CPU) or copied (on a device)
    here; immutable values pass as they are."""
    out = {}
    for k, v in scalars.items():
        if isinstance(v, torch.Tensor):
            v = v.detach()
            v = v.clone() if v.device.type != "cpu" and v.numel() == 1 else _metrics.plain(v)
        elif not isinstance(v, (int, float, str, bool, type(None))):
            v = _metrics.plain(v)
        out[k] = v
    return out
