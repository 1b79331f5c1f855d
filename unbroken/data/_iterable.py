"""Batching for iterable datasets that keep their own position (the Stateful protocol)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data as tud

from ..errors import ConfigError, DataError
from ..process import _signals
from ..state import Stateful
from ._contract import LoaderBase

ITERABLE_VERSION = 1


class IterableLoader(LoaderBase):
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

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        num_workers: int = 0,
    ) -> None:
        if num_workers:
            raise DataError(
                f"IterableLoader(num_workers={num_workers}): a dataset that keeps its own "
                "position is read in the main process only (workers would each hold a copy of "
                "the position). For workers, give the data as shards: "
                "unbroken.data.JsonlShards (JSONL files) or unbroken.data.IterableShards (a "
                "sharded IterableDataset, e.g. Hugging Face's); or use num_workers=0"
            )
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
        # The dataset splits itself by rank if it needs to; these are what Run cross-checks.
        self._init_base(None, None)
        # The dataset's iterator ran out (the pass's last batch may still be being consumed),
        # and the consumer has seen the pass end; only the latter moves on to the next epoch.
        self._exhausted = False
        self._ended = False

    def __iter__(self) -> Iterator[Any]:
        if self._ended:
            self.epoch, self.position = self.epoch + 1, 0
            self._ended = self._exhausted = False
        # A pass resumed after its last batch yields nothing: the consumer sees the epoch end.
        it = iter(()) if self._exhausted else iter(self.dataset)  # type: ignore[call-overload]
        while True:
            _signals.at_fetch(self)  # a safe point for a requested stop (between steps)
            items = []
            for item in it:
                items.append(item)
                if len(items) == self.batch_size:
                    break
            else:
                self._exhausted = True
            if not items or (self.drop_last and len(items) < self.batch_size):
                # Like MapLoader: ``epoch`` stays the finished epoch until the next pass.
                self._ended = self._exhausted = True
                return
            self._count(len(items))
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
