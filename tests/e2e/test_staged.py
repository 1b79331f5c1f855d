"""Staged training: schedules, callbacks, model growth -- exact through interruptions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from tests.golden import ROOT, assert_identical, run_interrupted
from unbroken.train import _staging

INTERRUPT = ROOT / "tests" / "scripts" / "interrupt.py"
STAGED = ROOT / "examples" / "staged.py"


def test_staged_example_interrupted_around_every_change(tmp_path: Path, reference_runs) -> None:
    """Changes at step starts (counters.step == c): batch size 40 and 80, growth 52 (epoch 2
    starts), grad_accum 68 (epoch 3 starts), widening 70. Each is interrupted just before (a
    checkpoint right before it), exactly at (signal right after the change, before the step
    ends: KILL replays the change, TERM saves the changed model) and just after."""
    args = [str(STAGED), "--steps", "90", "--save-every", "5"]
    ref = tmp_path / "ref"
    run_interrupted(INTERRUPT, args, ref, [])
    interrupts = [
        (39, "KILL"),
        (40, "TERM", "start"),
        (51, "TERM"),
        (52, "KILL", "start"),
        (53, "TERM"),
        (67, "KILL"),
        (68, "TERM", "start"),
        (70, "KILL", "start"),
        (70, "TERM", "start"),
        (72, "KILL"),
        (79, "TERM"),
        (80, "KILL", "start"),
        (81, "TERM"),
    ]
    cut = tmp_path / "cut"
    run_interrupted(INTERRUPT, args, cut, interrupts)
    assert_identical(ref, cut)
    events = [r for r in unbroken.read_metrics(str(cut), events=True) if "event" in r]
    changes = [(e["step"], e["reason"]) for e in events if e["event"] == "model_changed"]
    assert changes == [(52, "on_epoch_start"), (70, "before_step")]


# ---- remapping of grown parameters -------------------------------------------------------------


class Small(torch.nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.fc = torch.nn.Linear(width, width)
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc(self.emb(idx)))


def _train(run: unbroken.Run, loader: Any, steps: int) -> None:
    for idx in run.loop(loader):
        run.model(idx).pow(2).mean().backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        run.ema.update()
        run.step()
        if run.counters.step >= steps:
            break


def _setup(tmp_path: Path, before_step: Any, **kw: Any) -> tuple[unbroken.Run, Any]:
    torch.manual_seed(0)
    model = Small(10, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ema = unbroken.EMA(model, decay=0.5)
    loader = unbroken.MapLoader(torch.arange(10), batch_size=4, seed=0)
    run = unbroken.Run(
        tmp_path / "run",
        model=model,
        optimizer=opt,
        ema=ema,
        loader=loader,
        before_step=before_step,
        model_factory=lambda stage: Small(*stage),
        stage=(10, 8),
        max_steps=6,
        progress=False,
        **kw,
    )
    return run, loader


def test_grown_linear_embedding_layernorm_moments_and_ema(tmp_path: Path) -> None:
    snap: dict[str, Any] = {}

    def before_step(ctx: Any) -> Any:
        if ctx.step == 3:
            old_state = {n: dict(ctx.optimizer.state[p]) for n, p in ctx.model.named_parameters()}
            snap["opt"] = {n: {k: v.clone() for k, v in s.items()} for n, s in old_state.items()}
            snap["ema"] = {k: v.clone() for k, v in ctx.run.ema.shadow.items()}
            new = Small(12, 16)
            snap["live"] = {k: v.clone() for k, v in new.state_dict().items()}
            return unbroken.train.Change(model=new, stage=(12, 16))
        return None

    run, loader = _setup(tmp_path, before_step)
    _train(run, loader, 3)
    # Step 4 starts: the change happens before its first batch.
    batches = run.loop(loader)
    next(batches)
    opt, model, ema = run.optimizer, run.model, run.ema
    assert isinstance(model, Small) and model.emb.weight.shape == (12, 16)
    for name, p in model.named_parameters():
        old = snap["opt"][name]
        new = opt.state[p]
        assert torch.equal(new["step"], old["step"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            lead = tuple(slice(0, s) for s in old[key].shape)
            assert torch.equal(new[key][lead], old[key]), (name, key)
            rest = new[key].clone()
            rest[lead] = 0
            assert torch.count_nonzero(rest) == 0, (name, key)
        lead = tuple(slice(0, s) for s in snap["ema"][name].shape)
        assert torch.equal(ema.shadow[name][lead], snap["ema"][name]), name
        rest_live = snap["live"][name].clone()
        rest_live[lead] = snap["ema"][name]
        assert torch.equal(ema.shadow[name], rest_live), name
    assert ema.model is model
    batches.close()
    run.close()


def _shrink_at_3(ctx: Any) -> Any:
    return unbroken.train.Change(model=Small(10, 6), stage=(10, 6)) if ctx.step == 3 else None


def test_grow_hook_remaps_a_shrunk_parameter_and_optimizer_factory_builds(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []
    built: list[torch.optim.Optimizer] = []

    def grow(name: str, what: str, old: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        calls.append((name, what))
        return old[tuple(slice(0, n) for n in shape)].clone()  # keep the leading slice

    def factory(model: torch.nn.Module) -> torch.optim.Optimizer:
        built.append(torch.optim.Adam(model.parameters(), lr=5e-3))
        return built[-1]

    run, loader = _setup(tmp_path, _shrink_at_3, grow=grow, optimizer_factory=factory)
    _train(run, loader, 3)
    old_avg = {
        n: run.optimizer.state[p]["exp_avg"].clone() for n, p in run.model.named_parameters()
    }
    old_ema = {k: v.clone() for k, v in run.ema.shadow.items()}
    batches = run.loop(loader)
    next(batches)  # step 4 starts: the change happens before its first batch
    assert run.optimizer is built[-1] and run.model.emb.weight.shape == (10, 6)
    names = ["emb.weight", "fc.weight", "fc.bias", "ln.weight", "ln.bias"]
    whats = ("param_state:exp_avg", "param_state:exp_avg_sq", "ema")
    assert sorted(calls) == sorted((n, w) for n in names for w in whats)
    for name, p in run.model.named_parameters():
        lead = tuple(slice(0, n) for n in p.shape)
        assert torch.equal(run.optimizer.state[p]["exp_avg"], old_avg[name][lead]), name
        assert torch.equal(run.ema.shadow[name], old_ema[name][lead]), name
    events = [r for r in unbroken.read_metrics(str(tmp_path / "run"), events=True) if "event" in r]
    change = next(e for e in events if e["event"] == "model_changed")
    assert sorted(change["remapped"]) == sorted(names) and change["grown"] == []
    batches.close()
    run.close()


@pytest.mark.parametrize(
    "hook,message",
    [
        (lambda n, w, old, shape: old, "grow= returned [10, 8] torch.float32"),
        (lambda n, w, old, shape: None, "is not growth; return a tensor of shape [10, 6]"),
    ],
    ids=["wrong-shape", "none-for-shrink"],
)
def test_grow_hook_result_is_checked(tmp_path: Path, hook: Any, message: str) -> None:
    run, loader = _setup(tmp_path, _shrink_at_3, grow=hook)
    with pytest.raises(unbroken.ConfigError, match="emb.weight") as e:
        _train(run, loader, 6)
    assert message in str(e.value)
    run.close()


@pytest.mark.parametrize(
    "result,message",
    [
        (5, "returned int"),
        ({"nonsense": 1}, "unknown setting(s) ['nonsense']"),
        (unbroken.train.Change(model=Small(10, 4), stage=(10, 4)), "'emb.weight' changed shape"),
        (unbroken.train.Change(model=Small(12, 16)), "without a stage"),
    ],
    ids=["wrong-type", "unknown-key", "shrunk", "no-stage"],
)
def test_bad_callback_return_is_named(tmp_path: Path, result: Any, message: str) -> None:
    def before_step(ctx: Any) -> Any:
        return result if ctx.step == 2 else None

    run, loader = _setup(tmp_path, before_step)
    with pytest.raises(unbroken.ConfigError) as e:
        _train(run, loader, 6)
    assert message in str(e.value)
    assert "before_step" in str(e.value) or "changed shape" in str(e.value)
    run.close()


def test_model_change_without_factory_is_refused(tmp_path: Path) -> None:
    def before_step(ctx: Any) -> Any:
        if ctx.step == 1:
            return unbroken.train.Change(model=Small(12, 16), stage=(12, 16))
        return None

    run, loader = _setup(tmp_path, before_step)
    run.config.model_factory = None
    with pytest.raises(unbroken.ConfigError, match="model_factory"):
        _train(run, loader, 6)
    run.close()


# ---- the order of events -----------------------------------------------------------------------


def _expected(steps: int, per_epoch: int, start: int = 0) -> list[tuple[Any, ...]]:
    """The documented order: on_epoch_start before the first step of each epoch, then
    before_step at every step start; a resume mid-epoch replays nothing."""
    out: list[tuple[Any, ...]] = []
    for s in range(start, steps):
        if s % per_epoch == 0:
            out.append(("epoch_start", s // per_epoch, s))
        out.append(("before_step", s // per_epoch, s))
    return out


def _recording_run(tmp_path: Path, log: list[tuple[Any, ...]], steps: int) -> unbroken.Run:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = unbroken.MapLoader(torch.randn(12, 2), batch_size=4, seed=1)
    return unbroken.Run(
        tmp_path / "events",
        model=model,
        optimizer=opt,
        loader=loader,
        on_epoch_start=lambda ctx: log.append(("epoch_start", ctx.epoch, ctx.step)),
        before_step=lambda ctx: log.append(("before_step", ctx.epoch, ctx.step)),
        settings=unbroken.train.Settings(lr=unbroken.train.StepTable({0: 0.1, 5: 0.01})),
        save_every=1,
        max_steps=steps,
        progress=False,
    )


@pytest.mark.parametrize("stop_at", [4, 6], ids=["mid-epoch", "epoch-boundary"])
def test_callback_order_also_after_resume(tmp_path: Path, stop_at: int) -> None:
    log: list[tuple[Any, ...]] = []
    run = _recording_run(tmp_path, log, 9)
    lrs = []
    for x in run.loop(run.registry.get("loader")):
        run.model(x).sum().backward()
        lrs.append(run.optimizer.param_groups[0]["lr"])
        run.optimizer.step()
        run.optimizer.zero_grad()
        run.step()
        if run.counters.step == stop_at:
            break
    run.close()
    assert log == _expected(stop_at, 3)
    assert lrs == [0.1 if s < 5 else 0.01 for s in range(stop_at)]
    log.clear()
    run = _recording_run(tmp_path, log, 9)
    for x in run.loop(run.registry.get("loader")):
        run.model(x).sum().backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        run.step()
    assert log == _expected(9, 3, start=stop_at)


def test_schedules() -> None:
    cos = unbroken.train.WarmupCosine(peak=1.0, total=10, warmup=2, final=0.1)
    assert cos(0, 0) == 0.5 and cos(1, 0) == 1.0 and abs(cos(10, 0) - 0.1) < 1e-12
    assert unbroken.train.LinearWarmup(2.0, 4)(1, 0) == 1.0
    assert unbroken.train.Piecewise([(0, 0.0), (10, 1.0)])(5, 0) == 0.5
    assert unbroken.train.StepTable({0: 16, 40: 32})(39, 0) == 16
    assert unbroken.train.EpochTable({0: 1, 3: 2})(0, 3) == 2
    assert unbroken.train.Constant(3)(100, 100) == 3
    values = unbroken.train.Settings(lr=cos, clip=1.0).at(1, 0, {"clip": 0.5})
    assert values.lr == 1.0 and values["clip"] == 0.5
    with pytest.raises(unbroken.ConfigError, match="epoch 0"):
        unbroken.train.EpochTable({1: 2})
    assert _staging.grown(torch.ones(2), torch.Size([3]), None).tolist() == [1.0, 1.0, 0.0]
