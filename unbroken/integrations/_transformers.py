"""Hugging Face ``transformers``: a ``Trainer`` subclass with unbroken's exact resume.

``TransformersTrainer`` is a ``transformers.Trainer`` (same arguments) that drives an
:class:`unbroken.Run` from the Trainer's extension points (``get_train_dataloader``,
``training_step``, ``train``, a ``TrainerCallback``); nothing else is new. Four attributes the
Trainer keeps outside ``TrainerState`` (``_tr_loss``, ``_total_loss_scalar``,
``_globalstep_last_logged``, ``current_flos``) and ``_get_collator_with_removed_columns`` are
private names of transformers 5.23 (hence the extra's ``<6``):

- ``get_train_dataloader`` (documented for overriding) returns an ``unbroken.MapLoader`` built
  from ``train_dataset`` and the ``TrainingArguments`` (batch size, ``dataloader_num_workers``,
  seed, collator), handed to the Trainer as one stream without a length: the Trainer then runs
  ``max_steps`` optimizer steps over it (its loop keeps no data position of its own, so a
  resume needs none of its batch skipping) while the loader keeps the position, O(1).
- An internal ``TrainerCallback``, last in the list: ``on_train_begin`` (model, optimizer,
  scheduler and the Trainer's counters exist, no step ran) builds the Run over the model, the
  optimizer and scheduler, the GradScaler, the loader, the ``TrainerState`` (global step,
  epoch, log history, flos) with the Trainer's between-log loss accumulators, stateful
  callbacks and the RNG streams, and resumes them from the latest valid checkpoint.
- The Trainer logs, evaluates and would save a step *after* ``on_step_end`` and fetches the
  next step's micro-batches before ``on_step_begin``. So ``on_step_end`` notes the loader's
  position, and ``run.step()`` runs when the step is over: at the next ``on_step_begin`` (or
  ``on_epoch_end`` after the last step), saving the loader's position as it was at the step's
  end. The Trainer's own checkpoints (pickles) are switched off: ``save_steps`` becomes
  unbroken's ``save_every``, ``save_total_limit`` its ``keep_last``.
- The collator runs where the loader fetches -- with 0 workers in the main process between
  ``on_step_end`` and ``run.step()``, so after the step's end and before its save -- and
  ``DataCollatorForLanguageModeling`` masks from the global torch stream. The loader runs it
  with the global streams seeded from (seed, the batch's samples) and, in the main process,
  puts them back (``unbroken.data._global_streams.BatchSeeder``): the batches prefetched before a
  save leave the saved training stream untouched, and a resume collates them again to the
  same masks, with any number of workers. A collator with a generator of its own
  (``seed=``) is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import ConfigError
from ..process import _log
from ..train._config import RunConfig
from ..train._reduction import fix_layouts
from ._eval import protect_eval_loader

log = _log.get()

# Run options that make sense under a framework's loop (RunConfig marks them), but for those
# TrainingArguments already holds: max_steps, save_steps (save_every), save_total_limit
# (keep_last).
_OPTIONS = RunConfig.fields(framework=True) - {"save_every", "keep_last"}
# Trainer callbacks that keep nothing across steps that affects training.
_STATELESS = ("DefaultFlowCallback", "ProgressCallback", "PrinterCallback", "_UnbrokenHooks")
# TrainerState fields a resume restores (the others describe this launch's arguments).
_STATE_FIELDS = (
    "global_step",
    "epoch",
    "num_input_tokens_seen",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)
_UNSUPPORTED = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA", "TP")


class _Stream:
    """The loader as the Trainer sees it: batches across epochs, no length, no ``set_epoch``.

    Without a length the Trainer runs ``max_steps`` optimizer steps over one pass of this
    iterator; the epoch ends and the position are the ``unbroken.MapLoader``'s.
    """

    def __init__(self, loader: Any, hooks: Any) -> None:
        self.loader, self.hooks = loader, hooks

    def __iter__(self) -> Iterator[Any]:
        loader, empty = self.loader, 0
        while not self.hooks.done():
            if loader.epoch_finished():
                loader.set_epoch(loader.epoch + 1)
            got = False
            for batch in loader:
                got = True
                yield batch
            empty = 0 if got else empty + 1
            if empty > 1:
                raise ConfigError("the train dataset yielded no batch for a whole epoch")


class _StepEndPosition:
    """The loader as unbroken's Run tracks it: its position as of the last step's end.

    The Trainer fetches a step's micro-batches before ``on_step_begin``, where the previous step
    is saved; this view hides those prefetched batches from the checkpoint and the counters.
    """

    kind = "loader"
    rank_local = False

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._mark: dict[str, Any] | None = None

    def mark(self) -> None:
        dl = self.loader
        self._mark = {
            "state": dl.state_dict(),
            "epoch": dl.epoch,
            "position": dl.position,
            "yielded_batches": dl.yielded_batches,
            "yielded_samples": dl.yielded_samples,
        }

    def _get(self, key: str) -> Any:
        return self._mark[key] if self._mark is not None else getattr(self.loader, key)

    epoch = property(lambda self: self._get("epoch"))
    position = property(lambda self: self._get("position"))
    yielded_batches = property(lambda self: self._get("yielded_batches"))
    yielded_samples = property(lambda self: self._get("yielded_samples"))
    rank = property(lambda self: self.loader.rank)
    world_size = property(lambda self: self.loader.world_size)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return dict(self._mark["state"]) if self._mark is not None else self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)
        self._mark = None


class _TrainerProgress:
    """``trainer.state`` (global step, epoch, log history, flos) and the loss and flos summed
    since the last log, which the Trainer keeps outside its state."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        state = {k: getattr(t.state, k) for k in _STATE_FIELDS}
        state["log_history"] = [dict(e) for e in t.state.log_history]
        return {
            "state": state,
            "tr_loss": float(t._tr_loss.item()),
            "total_loss_scalar": float(t._total_loss_scalar),
            "globalstep_last_logged": int(t._globalstep_last_logged),
            "current_flos": float(t.current_flos),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        t = self.trainer
        for k, v in state_dict["state"].items():
            setattr(t.state, k, v)
        t._tr_loss.fill_(state_dict["tr_loss"])
        t._total_loss_scalar = state_dict["total_loss_scalar"]
        t._globalstep_last_logged = state_dict["globalstep_last_logged"]
        t.current_flos = state_dict["current_flos"]


def _seeded_collator(collator: Any) -> Any:
    """A collator masking from a generator of its own (``DataCollatorForLanguageModeling(
    seed=...)``): ``collator`` itself, or one it holds (a wrapper that crops first, a
    ``functools.partial``), else None."""
    held = [collator, getattr(collator, "func", None)]
    try:
        held += list(vars(collator).values())
    except TypeError:  # no __dict__ (slots, a builtin)
        pass
    for c in held:
        if getattr(c, "seed", None) is not None and hasattr(c, "generator"):
            return c
    return None


def _trainer_class() -> type:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "TransformersTrainer needs transformers: pip install 'unbroken[transformers]'"
        ) from None
    return transformers.Trainer


def _callback_base() -> type:
    import transformers

    return transformers.TrainerCallback


def _make_hooks_class() -> type:
    base = _callback_base()

    class _UnbrokenHooks(base):  # type: ignore[misc, valid-type]
        """The callback half of TransformersTrainer (see the module docstring)."""

        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer
            self.run: Any = None
            self.position: _StepEndPosition | None = None
            self.pending: dict[str, Any] | None = None
            self.lr: float | None = None
            self.fields: dict[str, Any] = {}  # unbroken_log(): fields of the step in progress

        def done(self) -> bool:
            return self.run is not None and (self.run.done or self.run.closed)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.run = self.trainer._unbroken_open(state)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            opt = self.trainer.optimizer
            self.lr = float(opt.param_groups[0]["lr"])  # before scheduler.step(): this step's

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.run is None:
                return
            assert self.position is not None
            self.position.mark()
            dl = self.position.loader
            # The Trainer's own epoch count restarts with every launch over the stream; this
            # one is the loader's (epochs done + the fraction of this one's samples consumed).
            state.epoch = dl.epoch + dl.position / max(1, len(dl.dataset))
            control.should_save = False  # unbroken saves; the Trainer writes no pickles
            self.pending = {"loss": self.trainer._unbroken_take_loss(), "lr": self.lr}
            self.pending["fields"], self.fields = self.fields, {}

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._commit()

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._commit()
            control.should_save = False

        def _commit(self) -> None:
            """``run.step()`` for the step that ended: logged, evaluated, before the next one."""
            if self.pending is None or self.run is None:
                return
            pending, self.pending = self.pending, None
            assert self.position is not None
            self.run.counters.epoch = self.position.epoch
            scalars = {"lr": pending["lr"]} if pending["lr"] is not None else {}
            for key, value in pending["fields"].items():
                scalars[key] = value.item() if isinstance(value, torch.Tensor) else value
            self.run.step(loss=pending["loss"], **scalars)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.run is not None and not self.run.closed:
                self.run.finish()

    return _UnbrokenHooks


_CLASS: list[type] = []


def __getattr__(name: str) -> Any:
    if name == "TransformersTrainer":
        if not _CLASS:
            _CLASS.append(_build())
        return _CLASS[0]
    raise AttributeError(name)


def _build() -> type:
    Trainer = _trainer_class()
    Hooks = _make_hooks_class()

    class TransformersTrainer(Trainer):  # type: ignore[misc, valid-type]
        """A ``transformers.Trainer`` whose ``train()`` resumes exactly from ``run_dir``.

        Takes the Trainer's arguments plus ``run_dir`` (default ``args.output_dir``),
        ``strict`` (default True: what cannot be resumed exactly is an error at start-up, else
        a warning), ``extra`` (more components to track, e.g. an ``unbroken.EMA``) and
        ``run_options`` (:class:`unbroken.Run` options such as ``time_limit`` or
        ``async_save``). ``TrainingArguments(max_steps=...)`` is required; ``save_steps`` is
        unbroken's ``save_every`` and ``save_total_limit`` its ``keep_last``. Call
        ``trainer.train()`` without ``resume_from_checkpoint``: it resumes by itself.
        """

        def __init__(
            self,
            *args: Any,
            run_dir: str | None = None,
            strict: bool = True,
            extra: Mapping[str, Any] | None = None,
            run_options: Mapping[str, Any] | None = None,
            **kwargs: Any,
        ) -> None:
            options = dict(run_options or {})
            unknown = sorted(set(options) - _OPTIONS)
            if unknown:
                raise ConfigError(
                    f"TransformersTrainer(run_options=...): {unknown} are not options here; it "
                    f"takes {sorted(_OPTIONS)} (max_steps, save_steps and save_total_limit come "
                    "from TrainingArguments)"
                )
            super().__init__(*args, **kwargs)
            self._unbroken_dir = run_dir or self.args.output_dir
            self._unbroken_strict, self._unbroken_extra = strict, dict(extra or {})
            self._unbroken_options = options
            self._unbroken_loader: Any = None
            self._unbroken_loss: Any = None
            self._unbroken_hooks = Hooks(self)
            self.add_callback(self._unbroken_hooks)  # last: after the flow and user callbacks
            self._unbroken_check_args()

        @property
        def unbroken_run(self) -> Any:
            """The :class:`unbroken.Run` behind this Trainer, from ``on_train_begin`` on
            (None before): ``trainer.unbroken_run.counters.step``, ``.resumed_from``, ..."""
            return self._unbroken_hooks.run

        def unbroken_log(self, **fields: Any) -> None:
            """Add fields to this step's line of ``metrics.jsonl`` (numbers; one-element
            tensors are read with ``.item()``), e.g. from ``compute_loss`` or a callback."""
            self._unbroken_hooks.fields.update(fields)

        # ---- start-up checks ------------------------------------------------------------------

        def _unbroken_inexact(self, message: str) -> None:
            if self._unbroken_strict:
                raise ConfigError(f"TransformersTrainer: {message} (or pass strict=False)")
            log.warning("unbroken: resume will not be exact: %s", message)

        def _unbroken_check_args(self) -> None:
            a = self.args
            if a.max_steps is None or a.max_steps <= 0:
                raise ConfigError(
                    "TransformersTrainer needs TrainingArguments(max_steps=N): it counts optimizer "
                    "steps over the data stream, not num_train_epochs"
                )
            strategy = str(getattr(a.save_strategy, "value", a.save_strategy))
            if strategy not in ("steps", "no"):
                self._unbroken_inexact(
                    f"save_strategy={strategy!r}: unbroken saves every save_steps steps (and on "
                    "a stop or the end); use save_strategy='steps' or 'no'"
                )
            if a.load_best_model_at_end:
                self._unbroken_inexact(
                    "load_best_model_at_end needs the Trainer's own checkpoints, which "
                    "TransformersTrainer does not write"
                )
            sampling = getattr(a, "train_sampling_strategy", "random")
            if sampling not in (None, "random"):
                self._unbroken_inexact(
                    f"train_sampling_strategy={sampling!r}: unbroken.MapLoader shuffles by "
                    "(seed, epoch); use 'random'"
                )
            if a.auto_find_batch_size:
                self._unbroken_inexact("auto_find_batch_size restarts the loop with other batches")
            seeded = _seeded_collator(self.data_collator)
            if seeded is not None:
                self._unbroken_inexact(
                    f"{type(seeded).__name__}(seed=...) masks from a generator of its own, "
                    "made per process and never saved, so a resume draws its numbers again from "
                    "the start; drop seed=: the loader seeds the global streams the collator "
                    "draws from per batch, from data_seed (or seed) and the batch's samples"
                )
            kind = str(getattr(self.accelerator.distributed_type, "name", ""))
            if kind in _UNSUPPORTED:
                self._unbroken_inexact(f"distributed type {kind} is not supported by unbroken")

        # ---- the Trainer's extension points ---------------------------------------------------

        def get_train_dataloader(self) -> Any:
            """An ``unbroken.MapLoader`` over ``train_dataset``, as one length-less stream."""
            from ..data import MapLoader

            if self.train_dataset is None:
                raise ValueError("Trainer: training requires a train_dataset.")
            if self._unbroken_loader is None:
                ds = self.train_dataset
                if isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__len__"):
                    raise ConfigError(
                        "TransformersTrainer needs a map-style train_dataset (with __len__); an "
                        "iterable one has no position unbroken.MapLoader can restore"
                    )
                a = self.args
                workers = a.dataloader_num_workers
                self._unbroken_loader = MapLoader(
                    ds,
                    batch_size=self._train_batch_size * a.world_size,  # global batch
                    shuffle=True,
                    seed=a.data_seed if a.data_seed is not None else a.seed,
                    drop_last=a.dataloader_drop_last,
                    num_workers=workers,
                    collate_fn=self._get_collator_with_removed_columns(
                        self.data_collator, description="training"
                    ),
                    pin_memory=bool(a.dataloader_pin_memory and torch.cuda.is_available()),
                    persistent_workers=bool(a.dataloader_persistent_workers and workers > 0),
                    prefetch_factor=a.dataloader_prefetch_factor if workers > 0 else None,
                    multiprocessing_context=a.dataloader_multiprocessing_context,
                )
            return _Stream(self._unbroken_loader, self._unbroken_hooks)

        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            """The Trainer's evaluation loader, its workers protected from a tree-wide stop and
            its iterator drawing nothing from the global random streams (see _eval.py)."""
            loader = super().get_eval_dataloader(eval_dataset)
            protect_eval_loader(loader)
            return loader

        def get_test_dataloader(self, test_dataset: Any) -> Any:
            loader = super().get_test_dataloader(test_dataset)
            protect_eval_loader(loader)
            return loader

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = super().training_step(model, inputs, num_items_in_batch)
            # The step's loss as the Trainer logs it with logging_steps=1: the micro-batch sum.
            self._unbroken_loss = (
                loss if self._unbroken_loss is None else self._unbroken_loss + loss
            )
            return loss

        def _unbroken_take_loss(self) -> Any:
            loss, self._unbroken_loss = self._unbroken_loss, None
            return loss

        def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            if resume_from_checkpoint not in (None, False):
                raise ConfigError(
                    "TransformersTrainer.train() resumes from its run directory by itself; drop "
                    "resume_from_checkpoint (the Trainer's own resume replays batches and is "
                    "not exact)"
                )
            try:
                return super().train(None, *args, **kwargs)
            finally:
                run = self._unbroken_hooks.run
                if run is not None and not run.closed:
                    run.close()  # a crash: release the lock; the last checkpoint stays

        # ---- the Run ---------------------------------------------------------------------------

        def _unbroken_open(self, state: Any) -> Any:
            from ..train import Run

            hooks = self._unbroken_hooks
            if self._unbroken_loader is None:
                raise ConfigError(
                    "TransformersTrainer: training ran without the unbroken.MapLoader that "
                    "TransformersTrainer.get_train_dataloader() builds (was the method "
                    "overridden?); its position is what a resume restores"
                )
            hooks.position = _StepEndPosition(self._unbroken_loader)
            comps: dict[str, Any] = {"model": self.model}
            comps["optimizer"] = getattr(self.optimizer, "optimizer", self.optimizer)
            comps["scheduler"] = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
            if getattr(self.accelerator, "scaler", None) is not None:
                comps["scaler"] = self.accelerator.scaler
            comps["loader"] = hooks.position
            comps["trainer_state"] = _TrainerProgress(self)
            comps.update(self._unbroken_callbacks())
            clash = sorted(set(comps) & set(self._unbroken_extra))
            if clash:
                raise ConfigError(f"TransformersTrainer(extra=...): {clash} are tracked already")
            comps.update(self._unbroken_extra)
            a = self.args
            strategy = str(getattr(a.save_strategy, "value", a.save_strategy))
            every = int(state.save_steps) if strategy == "steps" and state.save_steps else None
            options: dict[str, Any] = {"save_every": every, "max_steps": int(a.max_steps)}
            if a.save_total_limit is not None:
                options["keep_last"] = int(a.save_total_limit)
            options.update(self._unbroken_options)
            # The Trainer wrapped the model in DDP by now (on_train_begin, before the first
            # backward): one reduction layout, whenever the process started.
            fix_layouts([self.model_wrapped])
            return Run(self._unbroken_dir, **comps, **options)  # it announces a resume

        def _unbroken_callbacks(self) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for cb in self.callback_handler.callbacks:
                name = type(cb).__name__
                if name in _STATELESS:
                    continue
                if callable(getattr(cb, "state_dict", None)) and callable(
                    getattr(cb, "load_state_dict", None)
                ):
                    key, n = f"callback.{name}", 1
                    while key in out:
                        n += 1
                        key = f"callback.{name}.{n}"
                    out[key] = cb
                elif type(cb).__module__.startswith("transformers.integrations"):
                    log.warning(
                        "unbroken: %s logs to its own files, which a resume appends to "
                        "(not rewound)",
                        name,
                    )
                else:
                    self._unbroken_inexact(
                        f"callback {name} has no state_dict(); if it keeps state across steps, "
                        "that state starts fresh on resume. Give it state_dict()/"
                        "load_state_dict() to have it saved"
                    )
            return out

    TransformersTrainer.__module__ = __name__
    return TransformersTrainer
