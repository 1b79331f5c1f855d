"""A tqdm bar with the loss, an ETA and when the next save happens."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


class Progress:
    def __init__(self, total: int | None, initial: int) -> None:
        self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: Any, next_save: str) -> None:
        self._bar.update(step - self._bar.n)
        post = {}
        if loss is not None:
            try:
                post["loss"] = f"{float(loss):.4g}"
            except (TypeError, ValueError):
                pass
        if next_save:
            post["save"] = next_save
        self._bar.set_postfix(post, refresh=False)

    def close(self) -> None:
        self._bar.close()
