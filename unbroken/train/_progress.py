"""A tqdm bar with the loss, an ETA and when the next save happens."""

from __future__ import annotations

import time
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

    def set_total(self, total: int | None) -> None:
        if total is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def next_save_text(cfg: Any, step: int, last_save_wall: float, deadline: float | None) -> str:
    """The save triggers the bar can predict: "next save in 12 steps, 4.5 min", and when a
    time limit will stop (and save) the run."""
    parts, now = [], time.time()
    left_in_run = None if cfg.max_steps is None else cfg.max_steps - step
    if left_in_run is not None and left_in_run <= 0:
        return ""  # complete: the final save is being written, no other follows
    if cfg.save_every:
        left = cfg.save_every - step % cfg.save_every
        if left_in_run is not None and cfg.save_final:
            left = min(left, left_in_run)  # the final save comes first
        parts.append(f"{left} step{'' if left == 1 else 's'}")
    if cfg.save_every_minutes is not None:
        left = cfg.save_every_minutes * 60 - (now - last_save_wall)
        parts.append(f"{max(0.0, left) / 60:.1f} min")
    text = f"next save in {', '.join(parts)}" if parts else ""
    if deadline is not None:
        left = deadline - cfg.time_margin - now
        text += f"{'; ' if text else ''}stop and save in {max(0.0, left) / 60:.1f} min"
    return text


def steps_for_epochs(loader: Any, counters: Any, num_epochs: int) -> int | None:
    """The step count at the end of ``num_epochs`` epochs (one step per batch of ``loader``;
    an estimate if the script accumulates gradients), or None if the loader cannot say."""
    per_epoch = getattr(loader, "batches_per_epoch", None)
    if not callable(per_epoch):
        return None
    n = per_epoch()
    batch = getattr(loader, "batch_size", None)
    position = getattr(loader, "position", 0) or 0
    done = position // batch if isinstance(batch, int) and batch > 0 else 0
    return counters.step + max(0, (num_epochs - counters.epoch) * n - done)
