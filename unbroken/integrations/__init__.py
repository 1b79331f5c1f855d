"""Adapters that give framework users unbroken's exact resume (see docs/integrations.md), and
helpers for experiment trackers (docs/trackers.md).

One naming style: the framework's import name, then what you get -- ``LightningCallback`` is a
``lightning`` callback, ``TransformersTrainer`` a ``transformers.Trainer``, ``accelerate_run``
a function (hence snake case) that returns an ``unbroken.Run``; ``tensorboard_*`` and
``wandb_*`` likewise. Each lives in its own module and imports its framework only when it is
used, so ``import unbroken`` (and ``import unbroken.integrations``) never imports Lightning::

    from unbroken.integrations import LightningCallback
    trainer = Trainer(max_steps=1000, callbacks=[LightningCallback("runs/x", save_every=100)])

    from unbroken.integrations import accelerate_run
    run = accelerate_run(accelerator, "runs/x", loader=loader, save_every=100, max_steps=1000)

    from unbroken.integrations import TransformersTrainer  # a transformers.Trainer
    trainer = TransformersTrainer(model=model, args=TrainingArguments(max_steps=1000, ...), ...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:
    from ._accelerate import accelerate_run
    from ._lightning import LightningCallback
    from ._trackers import (
        tensorboard_purge_step,
        tensorboard_writer,
        wandb_init_args,
        wandb_run_id,
    )
    from ._transformers import TransformersTrainer

_LAZY = {
    "LightningCallback": "._lightning",
    "TransformersTrainer": "._transformers",
    "accelerate_run": "._accelerate",
    "tensorboard_purge_step": "._trackers",
    "tensorboard_writer": "._trackers",
    "wandb_init_args": "._trackers",
    "wandb_run_id": "._trackers",
}

# The names of the first releases (three styles for three adapters), kept for one release.
_DEPRECATED = {
    "LightningResume": "unbroken.integrations.LightningCallback",
    "UnbrokenTrainer": "unbroken.integrations.TransformersTrainer",
}

__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, _DEPRECATED)


__all__ = [
    "LightningCallback",
    "TransformersTrainer",
    "accelerate_run",
    "tensorboard_purge_step",
    "tensorboard_writer",
    "wandb_init_args",
    "wandb_run_id",
]
