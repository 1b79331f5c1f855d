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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._accelerate import accelerate_run
    from ._lightning import LightningResume
    from ._transformers import UnbrokenTrainer

_LAZY = {
    "LightningResume": "._lightning",
    "UnbrokenTrainer": "._transformers",
    "accelerate_run": "._accelerate",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unbroken.integrations' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["LightningResume", "UnbrokenTrainer", "accelerate_run"]
