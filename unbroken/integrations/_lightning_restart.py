"""Lightning's restart from a save taken in ``on_train_batch_end``: its validation and epochs.

``LightningCallback`` saves a step in ``on_train_batch_end``, before the validation Lightning
runs after that batch (and before the epoch end after an epoch's last batch). Lightning's
restart from such a state skips the validation due at that step (it counts it as run) and, at
an epoch's last batch, goes on without counting the next epoch as started. So:

- when a validation is due after the step, the saved fit-loop state says "a validation started
  and ran no batch" (the state of a save at that validation's start): the restart then runs it
  first, as the uninterrupted run did; the one extra batch that state counts as started is
  taken back when that validation starts (:func:`settle_validation`);
- at an epoch's last batch with no validation due, the next epoch is counted as ready and
  started on restart (:func:`count_epoch_started`).

These read and write Lightning's loop progress (``fit_loop`` and its state dict), which
Lightning 2.x saves in its own checkpoints too.
"""

from __future__ import annotations

from typing import Any

from ._eval import protect_eval_loader

_VAL = "epoch_loop.val_loop.batch_progress"
_TRAIN = "epoch_loop.batch_progress"


def validation_due(trainer: Any) -> bool:
    """Lightning will validate after the batch that just ended (``on_train_batch_end``)."""
    fit = trainer.fit_loop
    if fit._data_fetcher is None or not trainer.enable_validation:
        return False
    return bool(fit.epoch_loop._should_check_val_fx(fit._data_fetcher))


def mark_validation_started(state: dict[str, Any]) -> None:
    """Turn a fit-loop state taken in ``on_train_batch_end`` into that of the validation's
    start: the batch completed, one validation batch ready and started, none processed."""
    train = state[_TRAIN]
    for part in ("total", "current"):
        train[part]["completed"] = train[part]["processed"]
    val = state[_VAL]
    for key in ("ready", "started"):
        val["total"][key] = val["total"]["completed"] + 1
    val["total"]["processed"] = val["total"]["completed"]
    val["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    val["is_last_batch"] = False


def validation_started(state: dict[str, Any]) -> bool:
    """``state`` is one :func:`mark_validation_started` made."""
    total = state.get(_VAL, {}).get("total", {})
    return bool(
        total
        and total["ready"] == total["started"] == total["completed"] + 1
        and total["processed"] == total["completed"]
    )


def settle_validation(trainer: Any) -> None:
    """At the start of the validation a restart runs for a marked state: the batch the mark
    counted as started is counted again by this run; take the mark's back."""
    total = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
    total.ready -= 1
    total.started -= 1


def count_epoch_started(trainer: Any) -> None:
    """Resumed from a save at an epoch's last batch, Lightning finishes that epoch in its
    restart and goes on without counting the next one as ready and started (its restart stage
    stays "mid-epoch"): count it, as an uninterrupted run did at that epoch's start."""
    fit = trainer.fit_loop
    if (
        fit.restarted_mid_epoch
        and fit.epoch_loop.restarted_on_train_batch_end
        and fit.epoch_loop.batch_progress.is_last_batch
    ):
        fit.epoch_progress.increment_ready()
        fit.epoch_progress.increment_started()


def protect_val_loaders(trainer: Any, *, set_up: bool = False) -> None:
    """Protect the validation loaders' workers and give them their own generators, before any
    of their iterators exists (``set_up``: have Lightning build them now, as it would for the
    sanity check about to run)."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    if set_up:
        val_loop.setup_data()
    loader = val_loop._combined_loader
    for dl in loader.flattened if loader is not None else []:
        protect_eval_loader(dl)
