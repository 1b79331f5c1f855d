"""What ``unbroken verify`` does not compare, and why: fields that differ between any two runs
of the same script because they measure time, declared per integration that writes them.

A pattern is a dotted path (``COMPONENT.KEY``, a rank suffix ``@rankN`` dropped) in which ``*``
stands for part of one segment and ``**`` for any number of segments; it matches a path and
everything below it. A skipped path is listed in the report (:class:`NotCompared`), its list
indices shown as ``*``: never silently.

Checked and compared on purpose: the Trainer's ``total_flos`` counts operations (6 x input
tokens x parameters, per batch), not time, so it is equal in equal runs; Accelerate keeps no
timing in what unbroken tracks (model, optimizers, schedulers, scaler, accumulation counter).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True, slots=True)
class VolatileField:
    """Fields that an integration fills with wall-clock readings."""

    source: str
    """Who writes them: ``unbroken``, ``transformers``, ``lightning``."""
    pattern: str
    why: str


VOLATILE_FIELDS = (
    VolatileField("unbroken", "counters.train_seconds", "wall-clock seconds spent training"),
    VolatileField(
        "unbroken",
        "counters.metrics_offset",
        "the metrics log's length in bytes: an interrupted run's log also holds its resume events",
    ),
    # The Trainer's speed_metrics(): f"{split}_runtime" and f"{split}_{samples,steps,tokens}
    # _per_second" in the entries of TrainerState.log_history (what transformers' own
    # default_compute_objective drops as speed metrics).
    VolatileField(
        "transformers",
        "**.log_history.*.*_runtime",
        "the Trainer's wall-clock seconds of a train/eval/predict call",
    ),
    VolatileField(
        "transformers",
        "**.log_history.*.*_per_second",
        "the Trainer's throughput (samples, steps or tokens per wall-clock second)",
    ),
    # LightningCallback tracks every callback with a state_dict as callback.<class name>[.N].
    VolatileField(
        "lightning",
        "callback.Timer.**.time_elapsed",
        "Lightning's Timer callback: wall-clock seconds per stage",
    ),
)
"""What is left out of every comparison, by integration."""

VOLATILE = tuple(v.pattern for v in VOLATILE_FIELDS)
"""The patterns of :data:`VOLATILE_FIELDS`: state ``compare_runs`` never compares (wall-clock
time and throughput that frameworks log, the metrics log's length)."""


@dataclass(frozen=True, slots=True)
class NotCompared:
    """A field left out of the comparison: volatile, or named by ``--ignore``."""

    path: str
    """Its dotted path, list positions as ``*``: ``trainer_state.state.log_history.*.eval_runtime``
    (or the prefix ``--ignore`` named)."""
    source: str
    """The integration that declared it volatile, or ``--ignore``."""
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@lru_cache(maxsize=256)
def _regex(pattern: str) -> re.Pattern[str]:
    parts = []
    for token in re.split(r"(\*\*\.|\*\*|\*)", pattern):
        if token == "**.":
            parts.append(r"(?:[^.]+\.)*")
        elif token == "**":
            parts.append(r".*")
        elif token == "*":
            parts.append(r"[^.]*")
        else:
            parts.append(re.escape(token))
    return re.compile("".join(parts) + r"(?:\..*)?")


def matches(pattern: str, path: str) -> bool:
    """Whether ``path`` is ``pattern`` or below it (``*``: part of a segment, ``**``: any)."""
    return _regex(pattern).fullmatch(path) is not None


def volatile_rule(path: str) -> VolatileField | None:
    """The declaration that leaves ``path`` out, if any."""
    return next((v for v in VOLATILE_FIELDS if matches(v.pattern, path)), None)


def collapse(path: str) -> str:
    """``trainer_state.state.log_history.5.eval_runtime`` -> ``...log_history.*.eval_runtime``:
    list positions, so that one listing covers every entry."""
    return ".".join("*" if seg.isdigit() else seg for seg in path.split("."))


def listing(found: Iterable[NotCompared]) -> str:
    """One line's worth: paths grouped by why they were left out."""
    groups: dict[tuple[str, str], list[str]] = {}
    for n in found:
        groups.setdefault((n.source, n.why), []).append(n.path)
    return "; ".join(f"{', '.join(paths)} ({src}: {why})" for (src, why), paths in groups.items())
