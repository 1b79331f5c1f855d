"""Adapters that give framework users unbroken's exact resume (see docs/integrations.md).

Each adapter lives in its own module and imports its framework only when it is used, so
``import unbroken`` (and ``import unbroken.integrations``) never imports Lightning::

    from unbroken.integrations import LightningResume
    trainer = Trainer(max_steps=1000, callbacks=[LightningResume("runs/x", save_every=100)])

    from unbroken.integrations import accelerate_run
    run = accelerate_run(accelerator, "runs/x", loader=loader, save_every=100, max_steps=1000)

    from unbroken.integrations import UnbrokenTrainer  # a transformers.Trainer
    trainer = UnbrokenTrainer(model=model, args=TrainingArguments(max_steps=1000, ...), ...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:
    from ._accelerate import accelerate_run
    from ._lightning import LightningResume
    from ._transformers import UnbrokenTrainer

_LAZY = {
    "LightningResume": "._lightning",
    "UnbrokenTrainer": "._transformers",
    "accelerate_run": "._accelerate",
}


__getattr__, __dir__ = _lazy.exports(__name__, _LAZY)


__all__ = ["LightningResume", "UnbrokenTrainer", "accelerate_run"]
