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
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import _dist, _signals, _stops
from .._determinism import warn_determinism
from .._errors import ConfigError
from .._exit import EXIT_RESUMABLE
from ..data._contract import check_world, is_loader
from ..data._seeding import derive, seed_globals
from ..state import Counters, GlobalRNG, Registry
from ..store import AsyncSaver, CheckpointReader, CheckpointStore, Retention, WriterLock, step_name
from ._audit import Audit, refuse_untrackable
from ._choose import choose_checkpoint, restore, restore_or_fall_back
from ._config import RunConfig, deadline, option_hint, split_arguments
from ._events import Events
from ._loop import Stepper
from ._metrics import MetricsLog
from ._progress import Progress, next_save_text, steps_for_epochs
from ._signals import StopRequest, install_signal_handlers, process_start
from ._snapshots import Snapshots
from ._stopping import RepeatedStep, at_open, check_epoch, fetch_hook, honour

_RESERVED = ("counters", "rng")


class Run:
    """Track the components of a training run; resume them exactly; save them safely.

    Components are keyword arguments: modules, optimizers, LR schedulers, GradScalers,
    :class:`unbroken.EMA`, :class:`unbroken.DataLoader`, random generators and any object with
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
        self.config, kwargs = split_arguments(config, components, kwargs)
        self.dir = os.path.abspath(os.fspath(run_dir))
        self.rank, self.world_size = _dist.rank(), _dist.world_size()
        _dist.clean_exit()  # several ranks: exit with our status, never the backend's abort
        self.counters = Counters(stage=self.config.stage)
        self.registry = Registry()
        for name, obj in kwargs.items():
            if name in _RESERVED:
                raise ConfigError(f"component name {name!r} is reserved by unbroken; rename it")
            try:
                refuse_untrackable(obj)
                self.registry.add(name, obj)
            except ConfigError as e:
                raise ConfigError(f"Run keyword {name!r}: {e}{option_hint(name)}") from None
            if is_loader(obj):
                check_world(name, obj, self.rank, self.world_size)
        self.registry.add("counters", self.counters)
        self.registry.check_untracked_parameters()
        warn_determinism()  # on CUDA: the settings that make a bitwise resume impossible
        if self.config.track_rng:
            self.registry.add("rng", GlobalRNG())
        self.store = CheckpointStore(
            self.dir, Retention(self.config.keep_last, self.config.keep_every)
        )
        self._lock = WriterLock(self.dir)
        self._stop = StopRequest()
        self._metrics: MetricsLog | None = None
        self._progress: Progress | None = None
        self._closed = False
        self.resumed_from: int | None = None
        self._stepper = Stepper(self)
        self._async: AsyncSaver | None = None
        self.stopped = False
        self.last_saved_step: int | None = None
        self.last_save_seconds: float | None = None
        self._events = Events(self)
        self._open()
        self._audit = Audit(self)  # once resumed: what the loop start is compared with

    # ---- start-up -----------------------------------------------------------------------------

    def _open(self) -> None:
        if self.world_size == 1:
            _signals.honour_pending()  # a stop before Run(): nothing trained yet, exit 75 now
        _signals.run_opening()
        if self.config.handle_signals:
            # From now to process exit; until training starts a stop signal exits 75 at once
            # (resuming is not training: nothing is lost).
            install_signal_handlers()
        if self.rank == 0:
            os.makedirs(self.dir, exist_ok=True)
            self._lock.acquire()
            try:
                self.store.clean_stale()
            except BaseException:
                self._lock.release()
                raise
        _dist.set_report_dir(self.dir)  # where a timed-out collective names who did not answer
        _dist.barrier(what="start-up barrier")
        try:
            self._snapshots = Snapshots(self, self.config.snapshot_every)
            reader = choose_checkpoint(self)
            if reader is not None:
                restore_or_fall_back(self, reader)
            elif self.config.seed is not None:
                seed_globals(derive(self.config.seed, self.rank))
            if self.rank == 0 and self.config.metrics:
                # A metrics log that cannot be opened (a planted symlink, a FIFO, a full
                # disk) fails the start like a checkpoint would: the lock is released.
                self._metrics = MetricsLog(
                    self.dir, self.counters.metrics_offset, self.resumed_from
                )
                if self.resumed_from is not None:
                    self._metrics.event("resume", step=self.counters.step)
            if self.resumed_from is not None:
                self._events.resumed(self.resumed_from, self._path(self.resumed_from))
        except BaseException:
            self.close()
            raise
        self.last_saved_step = self.resumed_from
        if self.config.async_save:
            group = _dist.new_cpu_group() if self.world_size > 1 else None
            self._async = AsyncSaver(self.store, group)
        self._marks = self._loader_marks()
        self._epoch_save_pending = False
        self._start_wall = time.time()
        self._last_tick = time.perf_counter()
        self._last_save_wall = self._start_wall
        self._step_seconds: float | None = None
        # The budget is the process's: counted from its start, imports and resume included.
        self._deadline = deadline(process_start(), self.config)
        self._repeated = RepeatedStep()
        # With handle_signals=False, handlers installed already (the supervisor's) still count.
        self._stop.install(handlers=self.config.handle_signals)
        self._stop.at_fetch = fetch_hook(self)
        at_open(self)  # a stop while resuming: nothing trained, exit 75
        show = self.config.progress
        if show is None:
            show = sys.stderr.isatty()
        if show and self.rank == 0:
            self._progress = Progress(self.config.max_steps, self.counters.step)

    def _restore(self, reader: CheckpointReader) -> None:
        restore(self, reader)

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
        c = self.counters
        if self._async is not None:
            self._async.check()  # a background save that failed is raised at the next step
            self._events.deliver()  # on_save of a background save that committed since
        now = time.perf_counter()
        dt = now - self._last_tick
        self._last_tick = now
        c.step += 1
        c.train_seconds += dt
        self._step_seconds = dt if self._step_seconds is None else max(0.8 * self._step_seconds, dt)
        marks = self._loader_marks()
        self._repeated.check(self, marks[0], self._marks[0])
        c.samples += marks[1] - self._marks[1]
        self._marks = marks
        signalled, out_of_time, minutes_due, loss = self._agree(loss)
        if self._metrics is not None:
            record: dict[str, Any] = {"step": c.step, "epoch": c.epoch}
            if loss is not None:
                record["loss"] = loss
            record.update(scalars)
            self._metrics.step(record)
        if self._progress is not None:
            self._progress.update(c.step, loss, self._next_save_text())
        stop_reason = None
        if signalled:
            stop_reason = f"signal {self._stop.name or 'on another rank'}"
        elif out_of_time:
            stop_reason = "time limit"
        every = self.config.save_every
        save = stop_reason is not None or minutes_due or self._epoch_save_pending
        save = save or bool(every and c.step % every == 0)
        self._epoch_save_pending = False
        if self.done and self.config.save_final:
            c.complete = True
            save = True
            stop_reason = None  # the final save ends the run: exit 0, whatever signals came
        if stop_reason is not None and self._metrics is not None:
            # Logged before the save, so the checkpoint's log length includes it and a resume
            # (which truncates the log to that length) keeps it.
            self._metrics.event("stop", step=c.step, reason=stop_reason)
        if save:
            # A stop's checkpoint must be committed before the process exits.
            self.save(blocking=stop_reason is not None)
        if stop_reason is None:
            self._snapshots.after_step(c.step, saved=save)
        if stop_reason is not None:
            return self._halt(stop_reason)
        return self.done

    def _loader_marks(self) -> tuple[int, int]:
        """(batches, samples) yielded so far by the first tracked loader (the training one)."""
        loaders = self._loaders()
        if not loaders:
            return (0, 0)
        return (loaders[0].yielded_batches, loaders[0].yielded_samples)

    def _agree(self, loss: Any) -> tuple[bool, bool, bool, Any]:
        """(signalled, out of time, a timed save due, loss), agreed on by every rank.

        Each rank may see a signal or a clock the others do not; one all-reduce makes every
        rank stop and save at the same step (no rank left waiting in a collective). The logged
        loss is the mean over ranks.
        """
        signalled = self._stop.requested
        out_of_time = False
        if self._deadline is not None:
            need = (self._step_seconds or 0.0) + (self.last_save_seconds or 0.0)
            out_of_time = time.time() + need + self.config.time_margin >= self._deadline
        minutes = self.config.save_every_minutes
        minutes_due = minutes is not None and time.time() - self._last_save_wall >= minutes * 60
        shown = self._metrics is not None or self._progress is not None
        if isinstance(loss, torch.Tensor) and (shown or self.world_size > 1):
            # .item() waits for the device: only when the value is logged, shown or averaged.
            loss = loss.detach().float().mean().item()
        if self.world_size == 1:
            return signalled, out_of_time, minutes_due, loss
        flags = [float(signalled), float(out_of_time), float(minutes_due)]
        total = _dist.sum_floats([*flags, float(loss) if loss is not None else 0.0])
        mean = total[3] / self.world_size if loss is not None else None
        return total[0] > 0, total[1] > 0, total[2] > 0, mean

    def _extend(self, target: str) -> None:
        # A finished run asked for more: it continues (issue 17), and says so.
        self.counters.complete = False
        self._events.extended(target)

    def _halt(self, reason: str, *, saved: bool = True) -> bool:
        self.stopped = True
        self.close()
        if self.config.exit_on_stop:
            self._events.stopped(reason, saved=saved)
            _stops.record(self.counters.step, reason, self.rank, self.world_size)  # for launchers
            raise SystemExit(EXIT_RESUMABLE)  # every rank stops at this step (_dist.clean_exit)
        return True

    def _next_save_text(self) -> str:
        return next_save_text(self.config, self.counters.step, self._last_save_wall, self._deadline)

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Epoch numbers from the one in progress to ``num_epochs - 1``; then ``finish()``."""
        if self.config.before_step is not None or self.config.settings is not None:
            raise ConfigError(
                "settings and before_step are applied at step starts, which only run.loop() "
                "sees; use `for batch in run.loop(loader)` (with epochs= if you count epochs)"
            )
        self._audit.loop_started()
        if self._progress is not None and self.config.max_steps is None:
            loaders = self._loaders()
            self._progress.set_total(
                steps_for_epochs(loaders[0] if loaders else None, self.counters, num_epochs)
            )
        if self.counters.complete and self.counters.epoch < num_epochs:
            if self.config.max_steps is None:
                self._extend(f"{num_epochs} epochs")
        while self.counters.epoch < num_epochs and not self.done:
            epoch = self.counters.epoch
            loaders = self._loaders()
            for loader in loaders:
                if callable(getattr(loader, "set_epoch", None)):
                    loader.set_epoch(epoch)
            honour(self, f"the start of epoch {epoch}")
            if self.config.on_epoch_start is not None:
                first = not loaders or getattr(loaders[0], "position", 0) == 0
                if first:
                    self._stepper.begin_step(loaders[0] if loaders else None)
            # A whole epoch must hold a step (one resumed mid-way may end inside a step).
            whole = not loaders or getattr(loaders[0], "position", 0) == 0
            before = (self._loader_marks()[0], self.counters.step)
            yield epoch
            if self.done or self.stopped:
                break
            check_epoch(self, epoch, (self._loader_marks()[0] - before[0]) * whole, before[1])
            self._end_epoch(epoch + 1, last=epoch + 1 >= num_epochs)
        if not self.stopped:
            self.finish()

    def loop(self, loader: Iterable[Any], *, epochs: int | None = None) -> Iterator[Any]:
        """Batches across epochs until ``max_steps`` (or ``epochs``), then ``finish()``."""
        if self.config.max_steps is None and epochs is None:
            raise ConfigError("loop() needs max_steps (a Run option) or epochs=")
        yield from self._stepper.loop(loader, epochs)
        if not self.stopped:
            self.finish()

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

    def _log_event(self, kind: str, **fields: Any) -> None:
        if self._metrics is not None:
            self._metrics.event(kind, step=self.counters.step, **fields)
        if kind == "model_changed":
            self._events.model_changed(fields)

    def _end_epoch(self, next_epoch: int, *, last: bool = False) -> None:
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
        """Tracked loaders: components meeting unbroken.data.Loader (or tagged kind="loader")."""
        return [c.obj for c in self.registry if is_loader(c.obj)]

    # ---- saving -------------------------------------------------------------------------------

    def save(self, *, blocking: bool | None = None) -> str:
        """Save every component now (collective); returns the checkpoint's path.

        With ``async_save=True`` (and ``blocking`` not True) only the snapshot blocks; writing
        and committing finish in the background (see :class:`unbroken.store.AsyncSaver`).
        """
        t0 = time.perf_counter()
        c = self.counters
        if self._lock.held:
            self._lock.check()  # a deleted or replaced lock file: never two writers
        if self._metrics is not None:
            c.metrics_offset = self._metrics.offset()  # fsynced: on disk before the commit
        payload = self.registry.collect(self.rank)
        meta = {"epoch": c.epoch, "samples": c.samples, "stage": c.stage}
        path = self._path(c.step)
        if self._async is not None and not blocking:
            self._async.save(c.step, payload, meta, after=self._committed_in_background)
            # The time budget must allow for a whole save: use the last complete one.
            self.last_save_seconds = self._async.last_total_seconds or (time.perf_counter() - t0)
        else:
            if self._async is not None:
                self._async.wait()
            self.store.save(c.step, payload, meta)
            self._retain(c.step)
            self.last_save_seconds = time.perf_counter() - t0
            self._events.committed(c.step, path, self.last_save_seconds)
        self.last_saved_step = c.step
        self._last_save_wall = time.time()
        # Time spent saving is not a training step.
        self._last_tick += time.perf_counter() - t0
        self._events.deliver()
        return path

    def _path(self, step: int) -> str:
        return os.path.join(self.store.root, step_name(step))

    def _retain(self, step: int) -> None:
        if self.rank == 0:
            self.store.apply_retention(step)

    def _committed_in_background(self, step: int) -> None:
        self._retain(step)
        self._events.committed(step, self._path(step))

    def wait(self) -> None:
        """Wait for a background save to commit; raise its error if it failed."""
        if self._async is not None:
            self._async.wait()
        self._events.deliver()

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
        self.close()

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
            self.wait()
        finally:
            self._release()

    def _release(self) -> None:
        self._stop.uninstall()
        if self._progress is not None:
            self._progress.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._lock.held:
            self._lock.release()

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
