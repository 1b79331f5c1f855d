"""Golden tests: a run interrupted in a separate process and resumed equals an uninterrupted one.

The full matrix (workers {0,2} x interrupt {step 0, mid-epoch, epoch boundary, last step} x
{SIGTERM, SIGKILL} x accumulation {1,4} x GradScaler {on,off} x batch size changed on resume)
has 128 cells; the cases below cover every pair of values at least once (pairwise), plus
multi-interrupt and loop-style variants. With 96 samples and batch 8 an epoch is 12 batches.
"""

from __future__ import annotations

import pytest

from tests.conftest import TOY
from tests.golden import assert_identical, oracle_identical, run_interrupted

STEPS = 24


def _args(workers: int, accum: int, scaler: bool, extra: list[str] = ()) -> list[str]:
    args = ["--steps", str(STEPS), "--save-every", "5", "--workers", str(workers)]
    args += ["--accum", str(accum)]
    if scaler:
        args.append("--scaler")
    return [*args, *extra]


def _point(where: str, accum: int) -> int:
    per_epoch = 12 // accum
    return {
        "start": 0,
        "mid": per_epoch // 2 + 1,
        "boundary": per_epoch,
        "last": STEPS - 1,
    }[where]


CASES = [
    # workers, interrupt, signal, accum, scaler, batch change
    (0, "start", "TERM", 1, False, False),
    (0, "mid", "KILL", 4, True, False),
    (2, "boundary", "TERM", 4, False, False),
    (2, "last", "KILL", 1, False, False),
    (2, "start", "KILL", 4, True, True),
    (0, "boundary", "KILL", 1, True, True),
    (2, "mid", "TERM", 1, False, True),
    (0, "last", "TERM", 4, True, True),
]


@pytest.mark.parametrize(
    "workers,where,sig,accum,scaler,change",
    CASES,
    ids=[
        f"w{w}-{where}-{sig}-acc{a}-{'scaler' if s else 'noscaler'}-{'bs16' if c else 'bs8'}"
        for w, where, sig, a, s, c in CASES
    ],
)
def test_interrupted_equals_uninterrupted(
    tmp_path, reference_runs, workers, where, sig, accum, scaler, change
):
    step = _point(where, accum)
    extra: list[str] = []
    if change:
        # The batch size changes at the step the interrupted run resumes from: SIGTERM after
        # step k saves at k+1; SIGKILL after k loses back to the last save_every multiple.
        resume_step = step + 1 if sig == "TERM" else (step // 5) * 5
        extra = ["--batch-size-from", f"{resume_step}:16"]
    ref = reference_runs(_args(workers, accum, scaler, extra))
    base = _args(workers, accum, scaler)
    # A SIGKILL before the first save (step 5), or a stop before the first step, leaves no
    # checkpoint: the relaunch starts afresh, which must end the same too.
    resumable = step >= 5 or (sig != "KILL" and step > 0)
    run_interrupted(
        TOY,
        base,
        tmp_path,
        [(step, sig)],
        resume_args=_args(workers, accum, scaler, extra) if change else None,
        must_resume=resumable,
    )
    assert_identical(ref, tmp_path)


def test_many_interruptions_epochs_style(tmp_path, reference_runs):
    args = _args(2, 1, True, ["--style", "epochs", "--epoch-end-save", "--persistent"])
    ref = reference_runs(args)
    run_interrupted(TOY, args, tmp_path, [(3, "KILL"), (12, "TERM"), (16, "KILL"), (20, "INT")])
    assert_identical(ref, tmp_path)
    # The script's own record was compared too, not only what unbroken's reader reads back.
    assert oracle_identical(ref, tmp_path)


def test_protocol_dataset_and_usr1(tmp_path, reference_runs):
    args = _args(2, 2, False, ["--protocol"])
    ref = reference_runs(args)
    run_interrupted(TOY, args, tmp_path, [(7, "USR1"), (9, "KILL")])
    assert_identical(ref, tmp_path)


def test_async_save_interrupted_equals_uninterrupted(tmp_path, reference_runs):
    """Background saves: SIGKILL while a save may be in flight, SIGTERM (which waits for it)."""
    ref = reference_runs(_args(2, 1, True))
    args = _args(2, 1, True, ["--async-save"])
    run_interrupted(TOY, args, tmp_path, [(6, "KILL"), (10, "TERM"), (16, "KILL"), (21, "TERM")])
    assert_identical(ref, tmp_path)
