"""Bounded waits in unbroken's own collectives: real gloo ranks in separate processes; a rank
that never enters the collective is named by the others, within the timeout and its grace."""

from __future__ import annotations

import time

from tests.dist_launch import launch
from tests.golden import ROOT

SCRIPT = ROOT / "tests" / "scripts" / "bounded_collectives.py"


def test_collectives_complete_with_every_rank(tmp_path):
    codes, _ = launch(SCRIPT, ["--run-dir", str(tmp_path)], world=3, timeout=120)
    assert codes == [0, 0, 0]


def test_a_rank_that_does_not_answer_is_named(tmp_path):
    t0 = time.monotonic()
    codes, errs = launch(
        SCRIPT,
        ["--run-dir", str(tmp_path), "--absent", "2"],
        world=3,
        timeout=120,
        allowed=(0, 3),
    )
    assert codes == [3, 3, 0], errs
    for err in errs[:2]:
        assert "missing=[2]" in err and "rank(s) 2 did not answer" in err, err
        assert "commit verdict did not complete within 2 s" in err, err
    # Three torch imports and start-ups on 2 loaded cores take most of this; an unbounded
    # collective would wait for gloo's 30 min default and hit launch's 120 s first.
    assert time.monotonic() - t0 < 110
