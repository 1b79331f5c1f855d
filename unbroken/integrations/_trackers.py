"""Experiment trackers that show each step once, however often the run was resumed.

A resumed run redoes the steps after its checkpoint (identically). A tracker that was fed those
steps before the interruption would show them twice -- or reject them -- unless told:

- TensorBoard: ``SummaryWriter(purge_step=S)`` marks every event of step >= S in the earlier
  event files as orphaned; TensorBoard's reader drops them. S is the first step this launch
  logs: the checkpoint's step + 1 (1 on a fresh start: a launch killed before its first
  checkpoint left events of steps that are redone too).
- Weights & Biases: one run id for the whole training run, kept in the run directory, with
  ``resume="allow"``: every launch continues the same W&B run. W&B keeps a run's steps
  increasing, so a redone step is not recorded a second time (its values are the same).

Neither tracker is a dependency of unbroken; each helper imports its tracker when called.
"""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from ..train import Run

WANDB_ID_FILE = "wandb-run-id"
TENSORBOARD_DIR = "tensorboard"


def tensorboard_purge_step(run: Run) -> int:
    """The first step this launch logs, to pass as ``SummaryWriter(purge_step=...)``: the
    resumed checkpoint's step + 1, or 1 on a fresh start. Steps are numbered from 1: the step
    being completed is ``run.counters.step + 1`` until ``run.step()`` counts it."""
    return (run.resumed_from or 0) + 1


def tensorboard_writer(
    run: Run, log_dir: str | os.PathLike[str] | None = None, **kwargs: Any
) -> SummaryWriter:
    """A ``torch.utils.tensorboard.SummaryWriter`` for ``run`` (default directory
    ``RUN/tensorboard``) that hides what the steps redone since the checkpoint logged before
    the interruption. Log a step *before* ``run.step()``, with
    ``global_step=run.counters.step + 1``: a stop saves and exits inside ``run.step()``, and
    the step it saved is not redone after the resume. Under torchrun, create it on rank 0
    only. Other keyword arguments go to ``SummaryWriter``."""
    if "purge_step" in kwargs:
        raise ConfigError(
            "tensorboard_writer sets purge_step itself (from run.resumed_from); "
            "create a SummaryWriter directly to choose another"
        )
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"tensorboard_writer needs the tensorboard package ({e}): pip install tensorboard"
        ) from None
    target = os.fspath(log_dir) if log_dir is not None else os.path.join(run.dir, TENSORBOARD_DIR)
    return SummaryWriter(log_dir=target, purge_step=tensorboard_purge_step(run), **kwargs)


def wandb_run_id(run_dir: str | os.PathLike[str] | Run) -> str:
    """The W&B run id of this training run: read from ``RUN/wandb-run-id``, or made and stored
    there by the first launch (atomically: concurrent first launches agree on one id)."""
    root = _directory(run_dir)
    path = os.path.join(root, WANDB_ID_FILE)
    try:
        return _read_id(path)
    except FileNotFoundError:
        pass
    os.makedirs(root, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(secrets.token_hex(8) + "\n")  # W&B ids: letters and digits, at most 64
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # fails if another launch stored its id first: then use that one
    except FileExistsError:
        pass
    finally:
        os.remove(tmp)
    return _read_id(path)


def _directory(run: str | os.PathLike[str] | Run) -> str:
    if isinstance(run, (str, os.PathLike)):
        return os.fspath(run)
    return str(run.dir)


def _read_id(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        value = f.read().strip()
    if not value or len(value) > 64 or not value.isalnum():
        raise ConfigError(
            f"{path} does not hold a W&B run id (letters and digits, at most 64): "
            f"{value[:70]!r}; delete it to start a new W&B run"
        )
    return value


def wandb_init_args(run_dir: str | os.PathLike[str] | Run, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``wandb.init`` that make every launch of the training run continue
    one W&B run: ``{"id": <stored id>, "resume": "allow"}`` plus ``overrides`` (``project``,
    ``config``...). ``id`` and ``resume`` cannot be overridden: they are what this is for."""
    clash = sorted({"id", "resume"} & overrides.keys())
    if clash:
        raise ConfigError(f"wandb_init_args sets {', '.join(clash)} itself; pass the others only")
    return {"id": wandb_run_id(run_dir), "resume": "allow", **overrides}
