"""DDP inside PyTorch Lightning, the Hugging Face Trainer and Accelerate, at 3 ranks (gloo on
CPU): bit for bit across a SIGKILL and a SIGTERM, like plain DDP
(tests/e2e/test_ddp_world_sizes.py).

A new DistributedDataParallel reduces its first backward in one flat bucket, then in buckets
rebuilt in the order the gradients arrived. A relaunched process is a new DDP, so without
unbroken's fixed reduction layout (train/_reduction.py; each integration applies it to the
model as the framework wrapped it) its first step adds the ranks' gradients in another order
than the uninterrupted run's same step, and at 3 ranks the run drifts by the last bit.

Each case: an uninterrupted run (one per framework, shared) against one SIGKILLed at a drawn
logged step after the first checkpoint, relaunched, SIGTERMed at a later drawn step (every rank,
right after its ``run.step()``; exit 75), relaunched to the end; each relaunch a fresh set of
processes that must resume from a checkpoint; every tensor compared with ``torch.equal``, every
component's state and every logged step. ``UNBROKEN_TEST_SEED`` redraws the stops.

- Lightning: ``Trainer(accelerator="cpu", devices=3, strategy="ddp")`` over examples/
  lightning_lm.py's module (tests/scripts/lightning_ddp.py).
- Accelerate: examples/accelerate_lm.py unchanged, ``ACCELERATE_USE_CPU=true`` (what
  ``accelerate launch --cpu`` sets; without it ``Accelerator()`` on a machine without GPUs
  ignores torchrun's variables and trains each process alone), so MULTI_CPU: DDP over gloo.
- The Trainer: examples/hf_trainer_lm.py's GPT-2 with ``use_cpu=True`` (tests/scripts/
  hf_ddp.py). Its default ``ddp_find_unused_parameters`` is True for a PreTrainedModel, and a
  DDP that looks for unused parameters never rebuilds its buckets: that case is bit for bit even
  without the fixed layout (kept as a regression test); ``ddp_find_unused_parameters=False``
  (what activation checkpointing gets) is the case the layout fixes.

Lightning's SIGTERM notifier (2.5+) makes a ``dist.broadcast`` inside the signal handler on the
signalled ranks; a SIGTERM that reaches one rank alone (as a node's preemption does) ended the
job in a collective mismatch. ``test_lightning_sigterm_to_one_rank`` is that case.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dist_launch import launch
from tests.golden import ROOT, assert_identical, draw_stops, resume_steps

WORLD, STEPS, SAVE_EVERY = 3, 14, 4
INTERRUPT = ROOT / "tests" / "scripts" / "interrupt.py"
# (script, arguments): 3 ranks, a global batch of 24 (8 a rank), 96 windows (4 batches an
# epoch), width 64: enough gradient elements that another reduction order shows.
CASES: dict[str, tuple[Path, list[str]]] = {
    "lightning": (ROOT / "tests" / "scripts" / "lightning_ddp.py", []),
    "accelerate": (
        ROOT / "examples" / "accelerate_lm.py",
        ["--batch-size", "24", "--dim", "64", "--epoch-samples", "96", "--workers", "0"],
    ),
    "trainer": (ROOT / "tests" / "scripts" / "hf_ddp.py", []),
    "trainer-static": (
        ROOT / "tests" / "scripts" / "hf_ddp.py",
        ["--find-unused-parameters", "false"],
    ),
}
_references: dict[str, Path] = {}

pytestmark = pytest.mark.slow


def _args(case: str, run_dir: Path) -> list[str]:
    script, extra = CASES[case]
    common = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--run-dir", str(run_dir)]
    return [str(script), *extra, *common]


@contextlib.contextmanager
def _environment(case: str) -> Iterator[None]:
    """Accelerate picks DDP on CPU only when told to use the CPU (``accelerate launch --cpu``)."""
    if not case.startswith("accelerate"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCELERATE_USE_CPU", "true")
        yield


def _launch(case: str, args: list[str]) -> list[int]:
    pytest.importorskip(
        {"lightning": "pytorch_lightning", "accelerate": "accelerate"}.get(case, "transformers")
    )
    with _environment(case):
        codes, _ = launch(INTERRUPT, args, WORLD, timeout=420)
    return codes


def _world_size(run_dir: Path) -> int:
    from unbroken.store import CheckpointStore

    reader = CheckpointStore(str(run_dir)).latest()
    assert reader is not None, run_dir
    return reader.world_size


def _reference(case: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if case not in _references:
        ref = tmp_path_factory.mktemp(f"ref-{case}")
        assert _launch(case, _args(case, ref)) == [0] * WORLD
        assert _world_size(ref) == WORLD  # DDP: one run of 3 ranks, not 3 runs of one
        _references[case] = ref
    return _references[case]


@pytest.mark.parametrize("case", list(CASES))
def test_kill_and_stop_resume_bit_for_bit(
    case: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref = _reference(case, tmp_path_factory)
    seed = f"{os.environ.get('UNBROKEN_TEST_SEED', '45')}-{case}"
    kill, term = draw_stops(seed, STEPS, SAVE_EVERY)
    cut = tmp_path / "cut"
    args = _args(case, cut)
    assert _launch(case, [*args, "--signal-at", str(kill), "--signal", "KILL"]) == [-9] * WORLD
    assert _launch(case, [*args, "--signal-at", str(term), "--signal", "TERM"]) == [75] * WORLD
    assert _launch(case, args) == [0] * WORLD
    # Each relaunch resumed from a checkpoint: the last save before the kill, then the stop's
    # (the SIGTERM after step K is honoured, and saved, at the end of step K + 1).
    assert resume_steps(cut) == [kill // SAVE_EVERY * SAVE_EVERY, term + 1], (seed, kill, term)
    assert _world_size(cut) == WORLD
    assert_identical(ref, cut)


def test_lightning_sigterm_to_one_rank(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGTERM to rank 1 alone as step 7 starts: every rank saves step 7 and exits 75 (unbroken's
    stop agreement), and the relaunch ends bit for bit. Lightning's own notifier, chained after
    unbroken's handler, broadcast inside the handler on rank 1 alone: rank 1 aborted in gloo
    ("Received data size doesn't match expected size. Is there a distributed collective
    mismatch"), the others failed with "Connection reset by peer"."""
    ref = _reference("lightning", tmp_path_factory)
    cut = tmp_path / "cut"
    args = _args("lightning", cut)
    assert _launch("lightning", [*args, "--term-rank", "1", "--term-at", "6"]) == [75] * WORLD
    assert _launch("lightning", args) == [0] * WORLD
    assert resume_steps(cut) == [7]
    assert_identical(ref, cut)
