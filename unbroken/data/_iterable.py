"""Batching for iterable datasets that keep their own position (the Stateful protocol)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data as tud

from .._errors import ConfigError, DataError
from ..state import Stateful

ITERABLE_VERSION = 1


class IterableLoader:
    """Batches an iterable dataset in the main process and tracks its position.

    The dataset implements the Stateful protocol: ``state_dict()`` describes the position after
    the last item its iterator produced, and after ``load_state_dict()`` the next ``iter()``
    continues from there. Batches are taken in the main process with no prefetching, so the
    dataset's state at a step boundary is exactly what has been consumed::

        class Lines:
            def __init__(self, path): self.path, self.line = path, 0
            def __iter__(self):
                for i, text in enumerate(open(self.path)):
                    if i >= self.line:
                        self.line = i + 1
                        yield text
            def state_dict(self): return {"line": self.line}
            def load_state_dict(self, sd): self.line = sd["line"]

        loader = unbroken.IterableLoader(Lines("corpus.txt"), batch_size=8, collate_fn=list)
    """

    kind = "loader"
    rank_local = False

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(dataset, Stateful):
            raise ConfigError(
                f"IterableLoader needs a dataset with state_dict()/load_state_dict(); "
                f"{type(dataset).__qualname__} has not"
            )
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn or tud.default_collate
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        # The dataset's iterator ran out (the pass's last batch may still be being consumed),
        # and the consumer has seen the pass end; only the latter moves on to the next epoch.
        self._exhausted = False
        self._ended = False
        self.yielded_batches = 0
        self.yielded_samples = 0

    def __iter__(self) -> Iterator[Any]:
        if self._ended:
            self.epoch, self.position = self.epoch + 1, 0
            self._ended = self._exhausted = False
        # A pass resumed after its last batch yields nothing: the consumer sees the epoch end.
        it = iter(()) if self._exhausted else iter(self.dataset)  # type: ignore[call-overload]
        while True:
            items = []
            for item in it:
                items.append(item)
                if len(items) == self.batch_size:
                    break
            else:
                self._exhausted = True
            if not items or (self.drop_last and len(items) < self.batch_size):
                # Like DataLoader: ``epoch`` stays the finished epoch until the next pass.
                self._ended = self._exhausted = True
                return
            self.position += len(items)
            self.yielded_batches += 1
            self.yielded_samples += len(items)
            yield self.collate_fn(items)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": ITERABLE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "exhausted": self._exhausted,
            "ended": self._ended,
            "dataset": self.dataset.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != ITERABLE_VERSION:
            raise DataError(f"iterable loader state has version {state_dict.get('version')!r}")
        self.epoch = int(state_dict["epoch"])
        self.position = int(state_dict["position"])
        self._exhausted = bool(state_dict.get("exhausted", False))
        self._ended = bool(state_dict.get("ended", False))
        self.dataset.load_state_dict(state_dict["dataset"])
