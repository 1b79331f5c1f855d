"""Settings that are constants or pure functions of (step, epoch), and a few schedules.

Nothing about a schedule is saved: it is evaluated from the counters at each step start, so a
resumed run sees exactly the values an uninterrupted one sees. Values a callback sets (overrides)
are the exception: they are state, saved with the counters.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import ConfigError

Schedule = Callable[[int, int], Any]
KNOWN = ("lr", "batch_size", "grad_accum", "clip", "weight_decay")


class Settings:
    """Named values, each a constant or a callable ``f(step, epoch)``.

    ``step`` is the number of optimizer steps completed before the step being started (0 for
    the first) and ``epoch`` the epoch that step belongs to. Keys ``lr`` and ``weight_decay``
    are written into every optimizer param group (times the group's ``lr_scale`` /
    ``wd_scale`` if it has one), ``batch_size`` into the tracked loader, ``grad_accum`` sets the
    micro-batches per step in ``run.loop()``; ``clip`` and any other key are for you to read::

        settings = unbroken.train.Settings(
            lr=unbroken.train.WarmupCosine(peak=3e-3, warmup=100, total=1000),
            batch_size=unbroken.train.StepTable({0: 16, 200: 32}),
            grad_accum=unbroken.train.EpochTable({0: 1, 2: 2}),
            clip=1.0,
        )
    """

    def __init__(self, **values: Any) -> None:
        self._values = dict(values)
        for key in ("batch_size", "grad_accum"):
            v = self._values.get(key)
            if v is not None and not callable(v) and (not isinstance(v, int) or v < 1):
                raise ConfigError(
                    f"setting {key!r} must be a positive int or a schedule, got {v!r}"
                )

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def keys(self) -> list[str]:
        return list(self._values)

    def at(self, step: int, epoch: int, overrides: Mapping[str, Any] | None = None) -> Values:
        out = {}
        for k, v in self._values.items():
            out[k] = v(step, epoch) if callable(v) else v
        for k, v in (overrides or {}).items():
            out[k] = v
        return Values(step, epoch, out)


class Values(Mapping[str, Any]):
    """The settings' values for one step: ``values.lr`` or ``values["lr"]``."""

    def __init__(self, step: int, epoch: int, values: dict[str, Any]) -> None:
        self.step, self.epoch = step, epoch
        self._values = values

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __getattr__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"no setting named {key!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Values(step={self.step}, epoch={self.epoch}, {self._values})"


class Constant:
    """A setting's value that does not change with the step or epoch."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, step: int, epoch: int) -> Any:
        return self.value


class LinearWarmup:
    """From ``peak / warmup`` up to ``peak`` over ``warmup`` steps, then ``peak``."""

    def __init__(self, peak: float, warmup: int) -> None:
        if warmup < 1:
            raise ConfigError(f"warmup must be >= 1, got {warmup}")
        self.peak, self.warmup = peak, warmup

    def __call__(self, step: int, epoch: int) -> float:
        return self.peak * min(1.0, (step + 1) / self.warmup)


class WarmupCosine:
    """Linear warmup to ``peak``, then a cosine decay to ``final`` at step ``total``."""

    def __init__(self, peak: float, total: int, *, warmup: int = 0, final: float = 0.0) -> None:
        if total <= warmup:
            raise ConfigError(f"total ({total}) must exceed warmup ({warmup})")
        self.peak, self.total, self.warmup, self.final = peak, total, warmup, final

    def __call__(self, step: int, epoch: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        return self.final + 0.5 * (self.peak - self.final) * (1 + math.cos(math.pi * progress))


class Piecewise:
    """Linear interpolation between (step, value) points; constant outside them."""

    def __init__(self, points: list[tuple[int, float]]) -> None:
        if not points:
            raise ConfigError("Piecewise needs at least one (step, value) point")
        self.points = sorted(points)
        self._steps = [s for s, _ in self.points]

    def __call__(self, step: int, epoch: int) -> float:
        i = bisect.bisect_right(self._steps, step)
        if i == 0:
            return self.points[0][1]
        if i == len(self.points):
            return self.points[-1][1]
        (s0, v0), (s1, v1) = self.points[i - 1], self.points[i]
        return v0 + (v1 - v0) * (step - s0) / (s1 - s0)


class _Table:
    def __init__(self, table: Mapping[int, Any], by: str) -> None:
        if not table or min(table) > 0:
            raise ConfigError(f"a {by} table needs an entry for {by} 0, got {dict(table)!r}")
        self.table = dict(table)
        self._keys = sorted(self.table)

    def _lookup(self, key: int) -> Any:
        return self.table[self._keys[bisect.bisect_right(self._keys, key) - 1]]


class StepTable(_Table):
    """``{0: 16, 200: 32}``: 16 for steps 0..199, then 32."""

    def __init__(self, table: Mapping[int, Any]) -> None:
        super().__init__(table, "step")

    def __call__(self, step: int, epoch: int) -> Any:
        return self._lookup(step)


class EpochTable(_Table):
    """``{0: 1, 2: 4}``: 1 in epochs 0 and 1, then 4."""

    def __init__(self, table: Mapping[int, Any]) -> None:
        super().__init__(table, "epoch")

    def __call__(self, step: int, epoch: int) -> Any:
        return self._lookup(epoch)
