"""Where to interrupt the second run: K moments drawn from a seed, in step order.

A moment is a signal once the metrics log shows a step, or a SIGKILL as soon as a given save's
``.tmp-step-N`` directory appears (inside the save). A moment the run has already passed
(a signal lands a step or two late) moves to the next one that fits.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Target:
    """One planned interruption: a signal at a logged step, or SIGKILL inside a save."""

    kind: str  # "step" | "save"
    step: int
    signal: str  # "KILL" | "TERM"

    @property
    def moment(self) -> str:
        return f"step {self.step}" if self.kind == "step" else f"save of step {self.step}"


def plan_interrupts(k: int, seed: int, total: int, save_steps: Sequence[int]) -> list[Target]:
    """K moments drawn from ``seed``, in step order; with K >= 2 one is a SIGKILL inside a save.

    Moments come after the first checkpoint when there is room (an earlier kill only restarts
    from scratch); step targets alternate SIGKILL, SIGTERM, ... The SIGKILL inside a save comes
    first where the steps after it leave room for the others: the first launch takes it, and the
    relaunches resume from its half-written save. A moment is a target, not a promise: a
    fast run may be a step or two further when the signal lands, or done.
    """
    if k <= 0 or total < 2:
        return []
    rng = random.Random(seed)
    first = min(save_steps) if save_steps else 0
    lo = first + 1 if total - 1 - first >= k else 1
    save_target = None
    if k >= 2 and save_steps:
        later = [s for s in save_steps if s > first]
        # Room after the save for the other moments, off its next two steps and the last two.
        roomy = [s for s in later if total - 2 - (s + 3) >= k - 1]
        save_target = rng.choice(roomy or later or list(save_steps))
        if roomy:
            lo = save_target + 1
    n_steps = k - (save_target is not None)
    pool = [t for t in range(lo, total) if t != save_target]
    # Where there is room, keep signals off the last two steps (a fast run may finish before
    # the signal lands) and off the two steps before the save target (they would carry the
    # run past it).
    for near in (range(total - 2, total), range((save_target or 0) - 2, (save_target or 0) + 1)):
        spaced = [t for t in pool if t not in near]
        pool = spaced if len(spaced) >= n_steps else pool
    n_steps = min(n_steps, len(pool))
    steps = sorted(rng.sample(pool, n_steps))
    plan = [Target("step", t, "KILL" if i % 2 == 0 else "TERM") for i, t in enumerate(steps)]
    if save_target is not None:
        plan.append(Target("save", save_target, "KILL"))
    return sorted(plan, key=lambda t: t.step)


def next_target(
    pending: list[Target], last_seen: int, total: int, save_steps: list[int], notes: list[str]
) -> Target | None:
    """The next planned moment still ahead of the run (a passed one moves to the next fit)."""
    while pending:
        t = pending[0]
        if t.step > last_seen:
            return t
        moved: Target | None = None
        if t.kind == "step" and last_seen + 1 < total:
            moved = Target("step", last_seen + 1, t.signal)
        else:
            later = [s for s in save_steps if s > last_seen]
            moved = Target("save", later[0], t.signal) if t.kind == "save" and later else None
        pending.pop(0)
        if moved is None:
            notes.append(f"SIG{t.signal} at {t.moment} dropped: the run was already past it")
            continue
        pending.insert(0, moved)
        return moved
    return None
