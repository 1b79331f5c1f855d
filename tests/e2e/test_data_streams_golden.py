"""Golden tests of the watched global streams: interrupted in a separate process and resumed
equals uninterrupted, for a dataset drawing from torch's, NumPy's or Python's global stream,
and one that draws (from Python's) only from a sample first fetched at step 4 -- so the
resumed process finds the stream at another point than the uninterrupted one did (a resume
after step 4 meets it again only in epoch 1, which the late runs cover whole)."""

from __future__ import annotations

import pytest

from tests.conftest import TOY
from tests.golden import assert_identical, run_interrupted

CASES = [
    # noise, workers, interrupts
    ("torch", 0, [(3, "TERM"), (8, "KILL")]),
    ("numpy", 0, [(2, "KILL"), (7, "TERM")]),
    ("python", 2, [(6, "TERM"), (11, "KILL")]),
    ("late", 0, [(2, "TERM"), (6, "KILL")]),
    ("late", 2, [(2, "KILL"), (5, "TERM")]),
]


@pytest.mark.parametrize("noise,workers,interrupts", CASES, ids=[f"{n}-w{w}" for n, w, _ in CASES])
def test_watched_streams_resume_exactly(tmp_path, reference_runs, noise, workers, interrupts):
    steps = 26 if noise == "late" else 16
    args = ["--steps", str(steps), "--save-every", "5", "--workers", str(workers), "--noise", noise]
    ref = reference_runs(args)
    run_interrupted(TOY, args, tmp_path, interrupts)
    assert_identical(ref, tmp_path)
