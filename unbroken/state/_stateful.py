"""The one protocol every tracked component satisfies."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``.

    Modules, optimizers, LR schedulers, ``torch.amp.GradScaler`` and unbroken's own loaders
    qualify as they are; no base class is required. ``state_dict`` must return tensors, numbers,
    strings, lists, tuples and dicts only (anything else is rejected when saving, because loading
    must never unpickle).
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
