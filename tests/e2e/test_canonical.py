"""Canonical micro-shards (issue 19): bitwise the same run on 1, 2 and 3 gloo ranks, and across
a SIGKILL on 2 ranks resumed on 3, killed again and resumed on 1; without the mode it differs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import unbroken
from tests.dist_launch import launch
from tests.golden import ROOT, assert_identical, final_state, resume_steps
from unbroken.store import CheckpointStore

TOY = ROOT / "tests" / "scripts" / "canonical_toy.py"
CHAR_LM = ROOT / "examples" / "char_lm.py"
KILLED = -9
# Everything the mode composes with: dropout, AdamW, an lr schedule, 2 micro-batches per step,
# bf16 autocast with a GradScaler, clipping, an EMA; gradients exchanged in buckets of 100.
ARGS = ["--shards", "6", "--amp", "--accum", "2", "--bucket", "100"]


def _run(run_dir: Path, world: int, *extra: str) -> list[int]:
    return launch(TOY, ["--run-dir", str(run_dir), *ARGS, *extra], world)[0]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in unbroken.read_metrics(str(run_dir))]


def test_one_two_three_ranks_and_a_resume_across_them_are_bitwise_equal(tmp_path: Path) -> None:
    runs = {w: tmp_path / f"w{w}" for w in (1, 2, 3)}
    for world, run_dir in runs.items():
        assert _run(run_dir, world) == [0] * world
    assert_identical(runs[1], runs[2])
    assert_identical(runs[1], runs[3])
    assert len(_losses(runs[1])) == 8
    # Started on 2 ranks, SIGKILLed after step 4 (checkpoint 3); resumed on 3, SIGTERMed after
    # step 4 (the ranks agree at the next step: save 5, exit 75); resumed on 3 again, SIGKILLed
    # after step 7 (checkpoint 6); resumed on 1 to the end.
    cut = tmp_path / "cut"
    assert _run(cut, 2, "--signal-at", "4") == [KILLED] * 2
    assert CheckpointStore(str(cut)).latest().world_size == 2
    assert _run(cut, 3, "--signal-at", "4", "--signal", "TERM") == [75] * 3
    assert CheckpointStore(str(cut)).latest().step == 5
    assert _run(cut, 3, "--signal-at", "7") == [KILLED] * 3
    latest = CheckpointStore(str(cut)).latest()
    assert latest.step == 6 and latest.world_size == 3
    assert _run(cut, 1) == [0]
    assert resume_steps(cut) == [3, 5, 6]  # every relaunch resumed from a checkpoint
    assert_identical(runs[1], cut)


def test_without_the_mode_the_world_size_changes_the_bits(tmp_path: Path) -> None:
    """Plain DDP, even without dropout: the all-reduce sums in another order on 2 ranks."""
    common = ["--shards", "0", "--dropout", "0", "--steps", "2"]
    one, two = tmp_path / "w1", tmp_path / "w2"
    assert launch(TOY, ["--run-dir", str(one), *common], 1)[0] == [0]
    assert launch(TOY, ["--run-dir", str(two), *common], 2)[0] == [0, 0]
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_identical(one, two)
    ta, _ = final_state(one)
    tb, _ = final_state(two)
    differ = [k for k in ta if k.startswith("model/") and not torch.equal(ta[k], tb[k])]
    assert differ, "plain DDP gave the same bits on 1 and 2 ranks: the test shows nothing"
    # ... but only by rounding: the same run otherwise.
    assert all(torch.allclose(ta[k], tb[k], rtol=1e-3, atol=1e-5) for k in differ)


def test_char_lm_canonical_shards_gives_the_same_final_weights_on_1_and_2_ranks(
    tmp_path: Path,
) -> None:
    args = ["--steps", "2", "--context", "16", "--workers", "0", "--canonical-shards", "6"]
    args += ["--batch-size", "12", "--save-every", "1"]
    finals, traces = [], []
    for world in (1, 2):
        run_dir = tmp_path / f"w{world}"
        assert launch(CHAR_LM, ["--run-dir", str(run_dir), *args], world)[0] == [0] * world
        finals.append(load_file(str(run_dir / "final.safetensors")))
        lines = (run_dir / "trace.jsonl").read_text().splitlines()
        traces.append([json.loads(line)["loss"] for line in lines])
    assert finals[0].keys() == finals[1].keys() and finals[0]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    assert traces[0] == traces[1] and len(traces[0]) == 2


# ---- in one process -----------------------------------------------------------------------------


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_the_gradient_is_the_full_batch_mean_and_adds_to_what_p_grad_held() -> None:
    x, y = torch.randn(12, 4), torch.randn(12, 2)
    plain = _net()
    F.mse_loss(plain(x), y).backward()
    net = _net()
    canon = unbroken.train.CanonicalGradients(net, 3)
    for xs, ys in canon.shards(x, y):
        canon.backward(F.mse_loss(net(xs), ys))
    for p, q in zip(net.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    assert torch.allclose(canon.loss, F.mse_loss(plain(x), y).detach())
    before = [p.grad.clone() for p in net.parameters()]
    # Two unsynchronised calls then a synchronised one: three batches' gradients added on top.
    for sync in (False, False, True):
        for xs, ys in canon.shards(x, y, sync=sync):
            canon.backward(F.mse_loss(net(xs), ys))
        if not sync:
            assert all(
                torch.equal(p.grad, b) for p, b in zip(net.parameters(), before, strict=True)
            )
    for p, b, q in zip(net.parameters(), before, plain.parameters(), strict=True):
        assert torch.allclose(p.grad, b + 3 * q.grad, atol=1e-5)
    assert torch.allclose(canon.loss, 3 * F.mse_loss(plain(x), y).detach())


def test_dropout_draws_come_from_the_shard_not_the_rank_stream() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Dropout(0.5))
    canon = unbroken.train.CanonicalGradients(net, 2, seed=3)
    x = torch.randn(4, 4)
    torch.manual_seed(1)
    outs = []
    for (xs,) in canon.shards((x,)):
        out = net(xs)
        outs.append(out.detach())
        canon.backward(out.sum())
    after = torch.rand(1)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(1)), "the global stream was consumed"
    canon.calls = 0  # the same call again: the same masks; the next call: others
    torch.manual_seed(99)
    again = []
    for (xs,) in canon.shards((x,)):
        again.append(net(xs).detach())
        canon.backward(net(xs).sum())
    assert all(torch.equal(a, b) for a, b in zip(outs, again, strict=True))


def test_bad_use_gets_a_clear_error() -> None:
    net = _net()
    with pytest.raises(unbroken.ConfigError, match="positive int"):
        unbroken.train.CanonicalGradients(net, 0)
    canon = unbroken.train.CanonicalGradients(net, 4)
    with pytest.raises(unbroken.ConfigError, match="multiple of shards=4"):
        list(canon.shards(torch.randn(6, 4)))
    with pytest.raises(unbroken.ConfigError, match="inside canon.shards"):
        canon.backward(net(torch.randn(2, 4)).sum())
    with pytest.raises(unbroken.ConfigError, match="without canon.backward"):
        for _ in canon.shards(torch.randn(8, 4)):
            pass
    with pytest.raises(unbroken.ConfigError, match="first dimensions agree"):
        list(canon.shards(torch.randn(8, 4), torch.randn(6)))


def test_startup_and_resume_warnings() -> None:
    bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.warns(UserWarning, match="running statistics"):
        unbroken.train.CanonicalGradients(bn, 2)
    canon = unbroken.train.CanonicalGradients(_net(), 2)
    state = canon.state_dict()
    assert state["shards"] == 2 and state["threads"] == torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        canon.load_state_dict(state)
    with pytest.warns(UserWarning, match="intra-op threads"):
        canon.load_state_dict({**state, "threads": state["threads"] + 1})
    with pytest.warns(UserWarning, match="shards was 4"):
        canon.load_state_dict({**state, "shards": 4})


def test_a_world_size_not_dividing_k_and_fsdp2_are_refused() -> None:
    script = ROOT / "tests" / "scripts" / "canonical_refusals.py"
    codes, errs = launch(script, [], 2, allowed=(0,))
    assert codes == [0, 0]
    for err in errs:
        assert "3 shards cannot be split over 2 ranks" in err, err[-2000:]
        assert "does not support FSDP2" in err, err[-2000:]


def test_a_model_function_follows_a_model_change_at_a_step_boundary() -> None:
    current = [_net()]
    canon = unbroken.train.CanonicalGradients(lambda: current[0], 2)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    for sync in (False, True):
        for xs, ys in canon.shards(x, y, sync=sync):
            canon.backward(F.mse_loss(current[0](xs), ys))
    old = current[0]
    current[0] = torch.nn.Sequential(torch.nn.Linear(4, 2))
    for xs, ys in canon.shards(x, y):
        canon.backward(F.mse_loss(current[0](xs), ys))
    assert all(p.grad is not None for p in current[0].parameters())
    assert all(p.grad is not None for p in old.parameters())
    # Pending gradients of one model cannot be finished on another.
    for xs, ys in canon.shards(x, y, sync=False):
        canon.backward(F.mse_loss(current[0](xs), ys))
    current[0] = _net()
    with pytest.raises(unbroken.ConfigError, match="changed while gradients were pending"):
        list(canon.shards(x, y))
