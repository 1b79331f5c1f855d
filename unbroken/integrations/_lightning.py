"""PyTorch Lightning: one callback gives a ``Trainer`` unbroken's exact resume.

``LightningCallback(run_dir, save_every=N)`` is a Lightning ``Checkpoint`` callback (so Lightning
runs it after every other callback and adds no default ``ModelCheckpoint``). It drives an
:class:`unbroken.Run` from Lightning's hooks; nothing else is new:

- ``on_fit_start`` (optimizers and schedulers exist; Lightning's own checkpoint restore and
  loop start come after it): build the Run over the LightningModule, every optimizer and LR
  scheduler, the precision plugin (its GradScaler), stateful callbacks and datamodule, the fit
  loop's progress and the RNG streams. The Run resumes them from the latest valid checkpoint,
  exactly where Lightning's ``restore_training_state`` would.
- The train loader's position is the ``unbroken.MapLoader``'s own ``state_dict``, which
  Lightning's fit loop already saves and restores for stateful loaders (before it creates the
  epoch's iterator); a loader without one is refused at start-up.
- ``on_train_start`` (after Lightning registered its SIGTERM/SLURM handlers): install unbroken's
  stop handlers, which chain to Lightning's.
- ``on_train_batch_end`` after an optimizer step: ``run.step(loss, lr)``: log, save on the
  configured triggers, save and exit 75 on a signal or the time budget.
- From ``on_train_start`` until the run closes, Lightning's loops do not see its SIGTERM flag
  (:class:`_QuietSigterm`): Lightning would stop at the end of whatever batch the signal landed
  in -- a micro-batch of an accumulation window, a validation batch, after a validation or an
  epoch end -- where nothing can be saved that an uninterrupted run passes through. The stop is
  honoured by ``run.step()`` at the end of the optimizer step in progress, like SIGINT and
  SIGUSR1.
"""

from __future__ import annotations

import copy
import logging
import signal
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..data._contract import check_world
from ..errors import ConfigError
from ..process import _log
from ..process._exit import EXIT_RESUMABLE
from ..train._config import RunConfig
from ..train._reduction import fix_layouts
from . import _lightning_restart as restart

log = _log.get("lightning")

# Run options that make sense under a framework's loop (RunConfig marks them). max_steps comes
# from the Trainer; the signal handlers are installed by the callback itself, once Lightning
# has installed its own.
_OPTIONS = RunConfig.fields(framework=True)
# Lightning callbacks that keep nothing across steps that affects training.
_STATELESS = (
    "ProgressBar",
    "ModelSummary",
    "LearningRateMonitor",
    "DeviceStatsMonitor",
    "GradientAccumulationScheduler",
)


def _framework() -> Any:
    """The Lightning package the script uses: ``lightning.pytorch`` or ``pytorch_lightning``."""
    if "lightning.pytorch" in sys.modules and "pytorch_lightning" not in sys.modules:
        return sys.modules["lightning.pytorch"]
    try:
        import pytorch_lightning
    except ImportError:
        try:
            import lightning.pytorch as pl
        except ImportError:
            raise ConfigError(
                "LightningCallback needs PyTorch Lightning: pip install 'unbroken[lightning]'"
            ) from None
        return pl
    return pytorch_lightning


_CLASSES: dict[str, type] = {}


def step_fields(outputs: Any) -> dict[str, Any]:
    """The scalars ``training_step`` returned beside ``loss`` (``{"loss": l, "acc": a}``): each
    a field of the step's line in ``metrics.jsonl``. Tensors of one element, ints and floats."""
    if not isinstance(outputs, Mapping):
        return {}
    out: dict[str, Any] = {}
    for key, value in outputs.items():
        if key == "loss" or not isinstance(key, str):
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.detach().float().item()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value
    return out


def LightningCallback(  # noqa: N802 - reads as the class it returns
    run_dir: str,
    /,
    *,
    strict: bool = True,
    handle_signals: bool = True,
    extra: Mapping[str, Any] | None = None,
    **options: Any,
) -> Any:
    """A Lightning callback that makes ``trainer.fit`` resume exactly from ``run_dir``.

    ``options`` are :class:`unbroken.Run` options (``save_every``, ``save_every_minutes``,
    ``time_limit``, ``keep_last``, ``async_save``, ...); ``max_steps`` is the Trainer's.
    ``extra`` names more components to track (e.g. an ``unbroken.EMA``). With
    ``strict=False`` what cannot be resumed exactly is a warning instead of an error. With
    ``handle_signals`` (default) SIGTERM, SIGUSR1 and SIGINT save the step and exit 75; the
    handlers Lightning installed before (its SIGTERM notice, SLURM's requeue) still run.
    """
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ConfigError(
            f"LightningCallback: {unknown} are not options here; it takes {sorted(_OPTIONS)} "
            "(max_steps comes from Trainer(max_steps=...))"
        )
    pl = _framework()
    cls = _CLASSES.get(pl.__name__)
    if cls is None:
        cls = _CLASSES[pl.__name__] = _build(pl)
    return cls(run_dir, strict, handle_signals, dict(extra or {}), options)


class _QuietSigterm:
    """The trainer's signal connector as Lightning's loops see it while unbroken trains: its
    SIGTERM flag reads False.

    Lightning's SIGTERM notifier (which unbroken's handler chains to) sets the flag, and its
    loops raise ``SIGTERMException`` at the next batch end that reads it: after a micro-batch of
    an accumulation window (training_epoch_loop.py ``on_advance_end``), after a validation batch
    (evaluation_loop.py ``_evaluation_step``), after a validation that ran after the step, or
    after an epoch end (fit_loop.py ``on_advance_end``). The step before was saved with its own
    batch end's loop state, but the random streams, the callbacks and the validation's progress
    would be those of the later point: the resume replays the micro-batch with other dropout
    masks, or runs the validation a second time. Hidden, the flag is read by the callback at the
    next optimizer step's batch end instead (:meth:`sigterm`), where ``run.step()`` saves and
    exits 75. Everything else is the connector's (``__getattr__``); the flag set by the
    notifier lands on the connector itself."""

    def __init__(self, connector: Any) -> None:
        self.__dict__["_connector"] = connector

    @property
    def received_sigterm(self) -> bool:
        return False

    @received_sigterm.setter
    def received_sigterm(self, value: bool) -> None:
        self._connector.received_sigterm = value

    @property
    def sigterm(self) -> bool:
        """Lightning received a SIGTERM (its own flag)."""
        return bool(self._connector.received_sigterm)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_connector"], name)

    @staticmethod
    def hide(trainer: Any) -> _QuietSigterm:
        conn = trainer._signal_connector
        if not isinstance(conn, _QuietSigterm):
            _LocalNotifier.replace(conn, trainer)
            conn = trainer._signal_connector = _QuietSigterm(conn)
        return conn

    @staticmethod
    def show(trainer: Any) -> None:
        conn = getattr(trainer, "_signal_connector", None)
        if isinstance(conn, _QuietSigterm):
            trainer._signal_connector = conn._connector


class _LocalNotifier:
    """Lightning's SIGTERM notifier (``_SignalConnector._sigterm_notifier_fn``) without the
    ``dist.broadcast`` it makes since 2.5, in the signal handler, on the signalled ranks only.

    That collective pairs with whatever collective the other ranks issue next: a DDP bucket's
    all-reduce, unbroken's stop agreement, or Lightning's own per-batch SIGTERM broadcast. A
    SIGTERM that reaches one rank (a node's preemption), or reaches the ranks at different
    points of a step, ends the job in a collective mismatch (gloo: "op.preamble.length <=
    op.nbytes ... Received data size doesn't match expected size", an abort, the others
    "Connection reset by peer") instead of a save and exit 75. unbroken's own stop agreement
    at the step's end already stops every rank when any was signalled. The rest is Lightning's:
    its launcher forwards the signal to the ranks it started, and its flag is set (read by
    :class:`_QuietSigterm`)."""

    def __init__(self, connector: Any, trainer: Any) -> None:
        self.connector, self.trainer = connector, trainer

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.connector.received_sigterm:
            launcher = getattr(self.trainer.strategy, "launcher", None)
            if launcher is not None:
                launcher.kill(signum)
        self.connector.received_sigterm = True

    @staticmethod
    def replace(connector: Any, trainer: Any) -> None:
        """Put it in place of the connector's notifier in the SIGTERM handler Lightning
        registered (a ``_HandlersCompose`` calling each of its ``signal_handlers``)."""
        from ..process._signals import chained

        notifier = getattr(type(connector), "_sigterm_notifier_fn", None)
        for installed in (signal.getsignal(signal.SIGTERM), chained(signal.SIGTERM)):
            handlers = getattr(installed, "signal_handlers", None)
            if notifier is None or not isinstance(handlers, list):
                continue
            for i, handler in enumerate(handlers):
                if (
                    getattr(handler, "__self__", None) is connector
                    and getattr(handler, "__func__", None) is notifier
                ):
                    handlers[i] = _LocalNotifier(connector, trainer)


class _FitLoopState:
    """Lightning's fit-loop progress as a component (counters, restart stage, loader states).

    A save happens in ``on_train_batch_end`` (``run.step()``) with the loop state captured at
    that batch end, marked when a validation is due after it; a stop that Lightning itself
    raises (its SIGTERM exception, only before training starts: :class:`_QuietSigterm`) is
    saved with the same captured state, so every checkpoint resumes through the same restart
    path.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.at_step_end: dict[str, Any] | None = None
        self.validation_pending = False  # restored at a step whose validation had not run

    def state_dict(self) -> dict[str, Any]:
        live = self.trainer.fit_loop.state_dict()
        return {"fit_loop": self.at_step_end if self.at_step_end is not None else live}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(state_dict["fit_loop"])
        self.validation_pending = restart.validation_started(state_dict["fit_loop"])


def _build(pl: Any) -> type:
    Checkpoint = pl.callbacks.Checkpoint
    Callback = pl.callbacks.Callback
    SIGTERMException = pl.utilities.exceptions.SIGTERMException
    is_overridden = pl.utilities.model_helpers.is_overridden

    class LightningCallback(Checkpoint):  # type: ignore[misc, valid-type]
        """See :func:`unbroken.integrations.LightningCallback`."""

        def __init__(
            self,
            run_dir: str,
            strict: bool,
            handle_signals: bool,
            extra: dict[str, Any],
            options: dict[str, Any],
        ) -> None:
            super().__init__()
            self.run_dir, self.strict, self.extra, self.options = run_dir, strict, extra, options
            self.handle_signals = handle_signals
            self.run: Any = None
            self._loop: _FitLoopState | None = None
            self._lr: float | None = None
            self._sigterm: _QuietSigterm | None = None

        @property
        def state_key(self) -> str:
            # The key of this callback's entry in Lightning's own checkpoints: it keeps the
            # callback's first name, so checkpoints written before the rename still match.
            return f"unbroken.LightningResume[{self.run_dir}]"

        # ---- start-up -----------------------------------------------------------------------

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            from ..train import Run

            self._loop = _FitLoopState(trainer)
            comps: dict[str, Any] = {"model": pl_module}
            for i, opt in enumerate(trainer.optimizers):
                comps["optimizer" if i == 0 else f"optimizer.{i}"] = opt
            for i, cfg in enumerate(trainer.lr_scheduler_configs):
                comps["scheduler" if i == 0 else f"scheduler.{i}"] = cfg.scheduler
            comps["precision"] = trainer.precision_plugin
            comps["fit_loop"] = self._loop
            dm = trainer.datamodule
            if dm is not None and is_overridden("state_dict", dm, pl.LightningDataModule):
                comps["datamodule"] = dm
            comps.update(self._callbacks(trainer))
            clash = sorted(set(comps) & set(self.extra))
            if clash:
                raise ConfigError(f"LightningCallback(extra=...): {clash} are tracked already")
            comps.update(self.extra)
            self._check_module(pl_module)
            max_steps = trainer.max_steps if trainer.max_steps >= 0 else None
            self.run = Run(
                self.run_dir, **comps, max_steps=max_steps, handle_signals=False, **self.options
            )

        def _callbacks(self, trainer: Any) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for cb in trainer.callbacks:
                if cb is self or isinstance(cb, LightningCallback):
                    continue
                name = type(cb).__name__
                if is_overridden("state_dict", cb, Callback):
                    key, n = f"callback.{name}", 1
                    while key in out:
                        n += 1
                        key = f"callback.{name}.{n}"
                    out[key] = cb
                elif not any(
                    isinstance(cb, c)
                    for c in (getattr(pl.callbacks, s, None) for s in _STATELESS)
                    if c is not None
                ):
                    self._inexact(
                        f"callback {name} has no state_dict(); if it keeps state across steps, "
                        "that state starts fresh on resume. Give it state_dict()/"
                        "load_state_dict() (Lightning's Callback API) to have it saved"
                    )
            return out

        def _check_module(self, pl_module: Any) -> None:
            name = type(pl_module).__name__
            for hook, why in (
                (
                    "on_train_batch_end",
                    "runs after unbroken saved the step, so state it changes there is saved a "
                    "step late; change it in training_step or on_before_zero_grad instead",
                ),
                (
                    "on_save_checkpoint",
                    "adds to Lightning's checkpoint dict, which unbroken does not write; keep "
                    "such state in a module buffer or pass its holder in extra=",
                ),
            ):
                if is_overridden(hook, pl_module, pl.LightningModule):
                    _log.event(log, logging.WARNING, "unbroken: %s.%s %s", name, hook, why)

        def _inexact(self, message: str) -> None:
            if self.strict:
                raise ConfigError(f"LightningCallback: {message} (or pass strict=False)")
            _log.event(log, logging.WARNING, "unbroken: resume will not be exact: %s", message)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            for dl in self._train_loaders(trainer):
                # A loader built before fit() started the process group is a one-process loader:
                # every rank would train on the whole global batch. Said, not trained on.
                check_world("train_dataloader", dl, trainer.global_rank, trainer.world_size)
                if getattr(dl, "kind", None) != "loader" or not hasattr(dl, "load_state_dict"):
                    self._inexact(
                        f"the train dataloader is a {type(dl).__module__}.{type(dl).__qualname__}, "
                        "whose mid-epoch position cannot be restored (Lightning would replay or "
                        "skip batches); use unbroken.MapLoader(dataset, batch_size, seed=...)"
                    )
            # Resumed from a save at an epoch's last batch, Lightning's restart moves on to the
            # next epoch without calling on_train_epoch_start; the loader must follow it now
            # (mid-epoch and fresh starts: the epoch in progress, a no-op).
            self._set_epoch(trainer)
            restart.count_epoch_started(trainer)
            restart.protect_val_loaders(trainer)  # built by now when a validation will run
            # The strategy wrapped the module in DDP by now (before the first backward): one
            # reduction layout, whenever the process started (train/_reduction.py).
            fix_layouts([getattr(trainer.strategy, "model", None)])
            if self.run is not None:
                self._sigterm = _QuietSigterm.hide(trainer)  # stops only at a step's end
            if self.run is not None and self.handle_signals:
                # Installed now, after Lightning's own (SIGTERM notifier, SLURM requeue on
                # SIGUSR1), so unbroken's handler chains to them instead of hiding them.
                self.run.install_signal_handlers()

        def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
            restart.protect_val_loaders(trainer, set_up=True)  # before their first iterator

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            if self._loop is not None and self._loop.validation_pending:
                if not trainer.sanity_checking:
                    restart.settle_validation(trainer)
                    self._loop.validation_pending = False

        # ---- the steps ----------------------------------------------------------------------

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self._set_epoch(trainer)

        @staticmethod
        def _train_loaders(trainer: Any) -> list[Any]:
            loader = trainer.fit_loop._combined_loader
            return list(loader.flattened) if loader is not None else []

        def _set_epoch(self, trainer: Any) -> None:
            # Lightning sets the epoch on a loader's sampler only; unbroken's loader is told
            # directly, as Run.epochs() does (a no-op for the epoch in progress).
            for dl in self._train_loaders(trainer):
                if callable(getattr(dl, "set_epoch", None)) and getattr(dl, "kind", "") == "loader":
                    dl.set_epoch(trainer.current_epoch)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._lr = float(optimizer.param_groups[0]["lr"])  # the lr this step uses

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            run = self.run
            if run is None or trainer.global_step == run.counters.step:
                return  # a micro-batch of a gradient-accumulation window: no optimizer step
            assert self._loop is not None
            self._loop.at_step_end = None
            self._loop.at_step_end = copy.deepcopy(trainer.fit_loop.state_dict())
            if restart.validation_due(trainer):  # saved before it: the restart must run it
                restart.mark_validation_started(self._loop.at_step_end)
            run.counters.epoch = trainer.current_epoch
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if not isinstance(loss, (torch.Tensor, float, int)):
                loss = None
            scalars = {"lr": self._lr} if self._lr is not None else {}
            scalars.update(step_fields(outputs))
            if self._sigterm is not None and self._sigterm.sigterm and not run._stop.requested:
                # A SIGTERM Lightning caught and unbroken's handler did not (handle_signals=
                # False): this step's end is where it is honoured.
                run._stop.record(signal.SIGTERM)
            run.step(loss=loss, **scalars)

        # ---- the end ------------------------------------------------------------------------

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.run is not None:
                self.run.finish()
            _QuietSigterm.show(trainer)

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            _QuietSigterm.show(trainer)
            run = self.run
            if run is None or run.closed:
                return
            if isinstance(exception, SIGTERMException):
                # Lightning's own SIGTERM stop, which it raises only before training starts
                # (the sanity check): save that step (unless saved already) and make the exit
                # resumable.
                run.stop("SIGTERM")
                exception.code = EXIT_RESUMABLE
                return
            run.close()  # a crash: release the lock; the last checkpoint stays the latest

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            _QuietSigterm.show(trainer)
            if self.run is not None and not self.run.closed:
                self.run.close()

    return LightningCallback
