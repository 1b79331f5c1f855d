"""Multi-process runs on torch.distributed (gloo, CPU, <= 3 ranks): DDP exact resume, FSDP2
resharding onto other world sizes, rank-agreed stop, a rank failing during a save."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

import unbroken
from tests.dist_launch import launch
from tests.golden import ROOT, assert_identical, final_state
from unbroken.store import CheckpointStore

TOY = ROOT / "tests" / "scripts" / "toy_dist.py"
KILLED = -9


def _run(run_dir: Path, world: int, *extra: str, allowed=(0, 75, KILLED), slurm: bool = False):
    return launch(TOY, ["--run-dir", str(run_dir), *extra], world, allowed=allowed, slurm=slurm)


def test_ddp_world2_interrupted_every_way_is_bitwise(tmp_path: Path) -> None:
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert _run(ref, 2)[0] == [0, 0]
    # SIGKILL of one rank: the other fails its next collective and exits (no hang).
    codes, _ = _run(cut, 2, "--signal-at", "5", "--signal-rank", "1", allowed=(1, KILLED))
    assert codes[1] == KILLED and codes[0] != 0
    # SIGKILL of all ranks, saving asynchronously (a background save may be in flight).
    assert _run(cut, 2, "--signal-at", "9", "--async-save")[0] == [KILLED, KILLED]
    # SIGTERM to rank 0 only: both ranks agree, save the same step and exit resumable.
    term = ["--signal-at", "13", "--signal", "TERM", "--signal-rank", "0", "--async-save"]
    assert _run(cut, 2, *term)[0] == [75, 75]
    assert CheckpointStore(str(cut)).latest().step == 14
    assert _run(cut, 2)[0] == [0, 0]
    assert_identical(ref, cut)


def test_ddp_model_change_is_rewrapped_and_resumes_into_the_new_stage(tmp_path: Path) -> None:
    """A callback widens the model at step 6 under DDP (world 2): the run wraps the new model
    in DDP again, and resumes into the widened stage (model_factory before loading)."""
    grow = ["--grow-at", "6"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert _run(ref, 2, *grow)[0] == [0, 0]
    # SIGKILL just before the change (checkpoint 4), then SIGTERM right after it (step 7).
    assert _run(cut, 2, *grow, "--signal-at", "5")[0] == [KILLED, KILLED]
    assert _run(cut, 2, *grow, "--signal-at", "7", "--signal", "TERM")[0] == [75, 75]
    assert CheckpointStore(str(cut)).latest().step > 6  # saved after the change
    assert _run(cut, 2, *grow)[0] == [0, 0]
    assert_identical(ref, cut)
    ta, _ = final_state(cut)
    assert [v.shape for k, v in ta.items() if k.startswith("model") and k.endswith("0.weight")]
    assert all(
        v.shape == (64, 8)
        for k, v in ta.items()
        if k.startswith("model") and k.endswith("0.weight")
    )
    events = [r for r in unbroken.read_metrics(str(cut), events=True) if "event" in r]
    assert [e["step"] for e in events if e["event"] == "model_changed"] == [6]


def test_srun_environment_two_ranks_stop_together_and_resume(tmp_path: Path) -> None:
    """Ranks described by SLURM's variables (as srun starts them) form the process group, agree
    on a SIGTERM sent to rank 1 only (as scancel --signal may), and resume bit for bit."""
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert _run(ref, 2, "--steps", "8", slurm=True)[0] == [0, 0]
    term = ["--steps", "8", "--signal-at", "3", "--signal", "TERM", "--signal-rank", "1"]
    assert _run(cut, 2, *term, slurm=True)[0] == [75, 75]
    manifest = CheckpointStore(str(cut)).latest()
    assert manifest is not None and manifest.world_size == 2 and manifest.step == 4
    assert _run(cut, 2, "--steps", "8", slurm=True)[0] == [0, 0]
    assert_identical(ref, cut)


def test_time_limit_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    """A 3 s budget with 0.1-0.2 s steps (rank 1 slower, so the ranks' clocks disagree): both
    ranks stop, save the same step and exit 75 before the budget; the resumed run is exact."""
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert _run(ref, 2)[0] == [0, 0]
    assert _run(cut, 2, "--time-limit", "3", "--step-sleep", "0.1")[0] == [75, 75]
    stopped = CheckpointStore(str(cut)).latest()
    assert stopped is not None and 1 <= stopped.step < 16
    stops = [r for r in unbroken.read_metrics(str(cut), events=True) if r.get("event") == "stop"]
    assert [r["step"] for r in stops] == [stopped.step] and "time" in stops[0]["reason"]
    assert _run(cut, 2)[0] == [0, 0]
    assert_identical(ref, cut)


def test_a_rank_failing_during_a_save_commits_nothing(tmp_path: Path) -> None:
    codes, errs = _run(tmp_path, 2, "--fail-save-at", "8", "--fail-rank", "1", allowed=(1,))
    assert codes == [1, 1]
    # Both ranks raise, naming the file whose write failed on rank 1.
    for err in errs:
        assert "CheckpointWriteError" in err and "tensors-r00001.bin" in err, err[-2000:]
    assert CheckpointStore(str(tmp_path)).latest().step == 4
    leftovers = [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".")]
    assert leftovers == []


def _samples(run_dir: Path) -> list[list[int]]:
    return [r["samples"] for r in unbroken.read_metrics(str(run_dir))]


def _assert_loaded_state_equals_checkpoint(run_dir: Path, dump: Path, step: int) -> None:
    """Right after loading on a new world size, the full (unsharded) model, optimizer and EMA
    tensors equal the tensors saved at ``step``, bit for bit."""
    reader = CheckpointStore(str(run_dir)).open(step)
    infos = reader.tensor_infos()
    saved = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in infos.items()}
    reader.load_tensors(saved)
    got = load_file(str(dump))
    assert got, "nothing was dumped"
    for key, value in got.items():
        assert key in saved, key
        assert torch.equal(value, saved[key]), key


def test_fsdp2_world2_resumes_on_world3_then_world1(tmp_path: Path) -> None:
    common = ["--mode", "fsdp", "--dropout", "0"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert _run(ref, 2, *common)[0] == [0, 0]
    assert _run(cut, 2, *common, "--signal-at", "9")[0] == [KILLED, KILLED]  # checkpoint 8
    # 2 shards resharded onto 3 ranks (rank 2 is new), then 3 onto 1.
    _, errs = _run(cut, 3, *common, "--dump-after-load", str(tmp_path / "w3.safetensors"))
    _assert_loaded_state_equals_checkpoint(cut, tmp_path / "w3.safetensors", 8)
    # The new rank is told its random streams could not be restored; the others are silent.
    new_rank = "rank 2 did not exist when step 8 was saved (world size 2)"
    assert new_rank in errs[2] and "did not exist" not in errs[0] + errs[1], errs[2][-2000:]
    # SIGTERM to a rank that does not commit: all three agree, save step 11 and exit 75.
    term = ["--signal-at", "10", "--signal", "TERM", "--signal-rank", "2"]
    assert _run(cut, 3, *common, *term)[0] == [75, 75, 75]
    _run(cut, 1, *common, "--dump-after-load", str(tmp_path / "w1.safetensors"))
    _assert_loaded_state_equals_checkpoint(cut, tmp_path / "w1.safetensors", 11)
    assert _run(cut, 1, *common)[0] == [0]
    # The data stream is the same global sequence whatever the world size.
    assert _samples(ref) == _samples(cut)
    # Values agree up to the reduction order of a different world size (documented tolerance).
    ta, _ = final_state(ref)
    tb, _ = final_state(cut)
    assert ta.keys() == tb.keys()
    for k in ta:
        if ta[k].is_floating_point():
            assert torch.allclose(ta[k], tb[k], rtol=1e-4, atol=1e-6), k
        else:
            assert torch.equal(ta[k], tb[k]), k
    la = [r["loss"] for r in unbroken.read_metrics(str(ref))]
    lb = [r["loss"] for r in unbroken.read_metrics(str(cut))]
    assert all(math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-6) for x, y in zip(la, lb, strict=True))
