"""What a comparison of two runs found (:class:`Comparison`, :class:`Difference`), and its JSON
form: importing this needs no torch, so that ``unbroken verify`` itself does not import it when the
comparison runs in a child of the fork server (:mod:`._compare_job`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ._volatile import NotCompared


@dataclass(frozen=True, slots=True)
class Difference:
    """The first place where the two runs disagree about one component (or metric)."""

    step: int
    """The checkpoint step (or, for the metrics log, the logged step) where it first differs."""
    component: str
    """A tracked component (``model``, ``rng``...), ``metrics`` or ``checkpoints``."""
    key: str
    """The path inside the component, with dots (``state.0.weight.exp_avg``); "" for all of it."""
    kind: str
    """``tensor``, ``state`` (JSON value), ``metric``, ``missing``, ``length`` or ``unreadable``."""
    reference: str
    """The uninterrupted run's value, shortened."""
    other: str
    """The interrupted run's value, shortened."""
    max_abs_diff: float | None = None
    """For tensors of equal shape: the largest absolute elementwise difference."""

    @property
    def where(self) -> str:
        return f"{self.component}.{self.key}" if self.key else self.component

    def describe(self) -> str:
        """E.g. ``optimizer.state.0.weight.exp_avg first differs at step 120 (max |Δ| 3e-05)``."""
        if self.kind == "tensor" and self.max_abs_diff is not None:
            detail = f"max |Δ| {self.max_abs_diff:.3g}"
        else:
            detail = f"{self.reference} vs {self.other}"
        return f"{self.where} first differs at step {self.step} ({detail})"

    def as_dict(self) -> dict[str, Any]:
        out = {**asdict(self), "where": self.where}
        if self.max_abs_diff is not None and not math.isfinite(self.max_abs_diff):
            out["max_abs_diff"] = str(self.max_abs_diff)  # strict JSON has no nan/inf
        return out


class FirstDifferences:
    """What a comparison and a verify report say first: ``differences`` holds the first
    difference of each component and metric, earliest first."""

    __slots__ = ()
    differences: list[Difference]

    @property
    def first_difference(self) -> Difference | None:
        """The earliest difference in tracked state, else the earliest in the metrics log."""
        state = [d for d in self.differences if d.component != "metrics"]
        return (state or self.differences)[0] if self.differences else None

    @property
    def first_metric_difference(self) -> Difference | None:
        return next((d for d in self.differences if d.component == "metrics"), None)


@dataclass(slots=True)
class Comparison(FirstDifferences):
    """What :func:`compare_runs` found."""

    steps: list[int]
    """Checkpoint steps compared (held by both runs)."""
    metrics_steps: int
    """Step records of the metrics log compared."""
    differences: list[Difference] = field(default_factory=list)
    """The first difference of each component (and of each metric), earliest first."""
    kinds: dict[str, str] = field(default_factory=dict)
    """Component name -> kind, from the reference's newest checkpoint."""
    schedulers: list[str] = field(default_factory=list)
    """Tracked components that look like LR schedulers."""
    untracked_params: dict[str, list[str]] = field(default_factory=dict)
    """Optimizer component -> its state keys of parameters no tracked module owns (``#4``:
    their moments are saved under a position, their values nowhere)."""
    audit: list[dict[str, Any]] = field(default_factory=list)
    """What the Run's start-up audit found (``audit`` events of either metrics log)."""
    step_counts: list[str] = field(default_factory=list)
    """Optimizer step counters that differ (``optimizer.state.0.weight.step``): the runs took
    a different number of optimizer steps (a GradScaler skipping others, say)."""
    not_compared: list[NotCompared] = field(default_factory=list)
    """What was left out: volatile fields found in the runs, and what ``ignore`` named."""
    world_size: int = 1
    """Ranks of the reference's newest checkpoint."""
    resumes: list[int] = field(default_factory=list)
    """Steps the interrupted run resumed from, as its metrics log records them."""
    after_resume: dict[int, dict[str, bool]] = field(default_factory=dict)
    """For the first step after each resume: logged key -> whether both runs logged the same."""

    @property
    def passed(self) -> bool:
        return not self.differences


def comparison_to_json(cmp: Comparison) -> dict[str, Any]:
    """A :class:`Comparison` as JSON (:func:`comparison_from_json` reads it back)."""
    out = {k: getattr(cmp, k) for k in Comparison.__dataclass_fields__}
    out["differences"] = [asdict(d) for d in cmp.differences]
    out["not_compared"] = [n.as_dict() for n in cmp.not_compared]
    out["after_resume"] = [[step, keys] for step, keys in cmp.after_resume.items()]
    return out


def comparison_from_json(data: dict[str, Any]) -> Comparison:
    fields = dict(data)
    fields["differences"] = [Difference(**d) for d in data["differences"]]
    fields["not_compared"] = [NotCompared(**n) for n in data["not_compared"]]
    fields["after_resume"] = {int(step): keys for step, keys in data["after_resume"]}
    return Comparison(**fields)
