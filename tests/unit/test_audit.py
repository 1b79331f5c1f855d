"""The start-up audit names what would silently lose exactness (issue 17, findings 2-4).

Found from outside: a plain torch DataLoader given to ``run.loop()`` restarted its epoch after a
resume without a word (finding 2); random draws between ``Run()`` and the loop made every
resumed run diverge, silently (finding 3); after a model change the script's own optimizer
object trained nothing, silently (finding 4).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken import ConfigError, ResumeWarning, StateError

DATA = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(12, 1))


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(6.0))


def _run(path: Path, **kw) -> unbroken.Run:
    return unbroken.Run(path, max_steps=kw.pop("max_steps", 3), progress=False, **kw)


# ---- finding 2: data sources with no position -------------------------------------------------


@pytest.mark.parametrize(
    ("source", "names"),
    [
        pytest.param(
            torch.utils.data.DataLoader(DATA, batch_size=4), "unbroken.MapLoader", id="map"
        ),
        pytest.param(
            torch.utils.data.DataLoader(Stream(), batch_size=2),
            "unbroken.IterableLoader",
            id="iter",
        ),
        pytest.param(torch.utils.data.RandomSampler(DATA), "unbroken.MapLoader", id="sampler"),
    ],
)
def test_a_plain_torch_source_in_loop_is_refused_naming_the_replacement(tmp_path, source, names):
    run = _run(tmp_path / "r")
    with pytest.raises(ConfigError, match="has no position to save") as e:
        next(iter(run.loop(source)))
    assert names in str(e.value)
    run.close()


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(torch.utils.data.DataLoader(DATA, batch_size=4), id="loader"),
        pytest.param(torch.utils.data.RandomSampler(DATA), id="sampler"),
    ],
)
def test_a_plain_torch_source_passed_to_run_names_unbroken_dataloader(tmp_path, obj):
    with pytest.raises(ConfigError, match=r"Run keyword 'data'.*unbroken\.MapLoader") as e:
        _run(tmp_path / "r", data=obj)
    assert "needs state_dict()" not in str(e.value)


def test_an_untracked_unbroken_loader_in_loop_is_refused(tmp_path):
    loader = unbroken.MapLoader(DATA, batch_size=4, seed=0)
    run = _run(tmp_path / "r")
    with pytest.raises(ConfigError, match="not a component of this Run"):
        next(iter(run.loop(loader)))
    run.close()


def test_a_wrapper_around_a_plain_loader_is_refused(tmp_path):
    class ToDevice:
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            return iter(self.inner)

    run = _run(tmp_path / "r")
    wrapped = ToDevice(torch.utils.data.DataLoader(DATA, batch_size=4))
    with pytest.raises(ConfigError, match=r"ToDevice\.inner, a plain torch"):
        next(iter(run.loop(wrapped)))
    run.close()


def test_tracked_loaders_and_positionless_iterables_pass(tmp_path):
    loader = unbroken.MapLoader(DATA, batch_size=4, seed=0)
    run = _run(tmp_path / "a", loader=loader)
    for _ in run.loop(loader):
        run.step()
    run = _run(tmp_path / "b")
    for _ in run.loop(range(10)):
        run.step()
    assert run.counters.step == 3


# ---- finding 3: random draws between Run() and the loop ---------------------------------------


def _train(run: unbroken.Run) -> None:
    for _ in run.loop(range(100)):
        run.step()


def test_a_torch_draw_after_run_is_named_at_loop_start(tmp_path):
    run = _run(tmp_path / "r", seed=0)
    torch.rand(3)  # fixed evaluation inputs, drawn at the wrong moment
    with pytest.warns(ResumeWarning, match="the torch global RNG .* advanced between Run"):
        _train(run)


def test_a_draw_after_a_resume_is_named_with_a_count(tmp_path):
    _train(_run(tmp_path / "r", max_steps=2))
    run = _run(tmp_path / "r", max_steps=4)
    assert run.resumed_from == 2
    random.random()  # two 32-bit words
    with pytest.warns(ResumeWarning, match=r"Python one by 2 32-bit words") as w:
        _train(run)
    assert "resumed its random streams" in str(w[0].message)
    assert "torch.Generator" in str(w[0].message)


def test_a_draw_from_a_tracked_generator_is_named(tmp_path):
    gen = torch.Generator().manual_seed(1)
    run = _run(tmp_path / "r", noise=gen)
    torch.randn(2, generator=gen)
    with pytest.warns(ResumeWarning, match="tracked generator 'noise'"):
        _train(run)


def test_draws_inside_the_loop_and_before_run_are_fine(tmp_path):
    torch.rand(3)  # before Run: replayed identically at every launch
    run = _run(tmp_path / "r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in run.loop(range(100)):
            torch.rand(2)  # dropout, augmentation: restored with the checkpoint
            run.step()


# ---- finding 4: the optimizer a model change replaced -----------------------------------------


def _grow(ctx):
    if ctx.step == 1 and ctx.stage == 1:
        return unbroken.train.Change(model=torch.nn.Linear(1, 2), stage=2)


def test_the_replaced_optimizer_and_model_refuse_to_train(tmp_path):
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = _run(
        tmp_path / "r",
        model=model,
        optimizer=opt,
        before_step=_grow,
        model_factory=lambda stage: torch.nn.Linear(1, stage),
        stage=1,
    )
    batches = run.loop(range(100))
    next(batches)
    opt.step()  # before the change: the tracked optimizer
    run.step()
    next(batches)  # step 1 starts: the model grows, the optimizer is rebuilt
    assert run.optimizer is not opt and run.model is not model
    with pytest.raises(StateError, match=r"optimizer was replaced at step 1.*run\.optimizer"):
        opt.step()
    with pytest.raises(StateError, match=r"model was replaced at step 1.*run\.model"):
        model(torch.ones(1, 1))
    run.model(torch.ones(1, 1)).sum().backward()
    run.optimizer.step()  # the current ones train
    run.step()
    run.close()


def test_a_new_model_wrapping_the_old_one_still_runs(tmp_path):
    model = torch.nn.Linear(1, 1)

    def wrap(ctx):
        if ctx.step == 1 and ctx.stage == 1:
            return unbroken.train.Change(
                model=torch.nn.Sequential(ctx.model, torch.nn.ReLU()), stage=2
            )

    run = _run(
        tmp_path / "r",
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        before_step=wrap,
        model_factory=lambda s: (
            torch.nn.Linear(1, 1)
            if s == 1
            else torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU())
        ),
        stage=1,
    )
    for _ in run.loop(range(100)):
        run.model(torch.ones(1, 1)).sum().backward()
        run.optimizer.step()
        run.step()
    assert run.stage == 2


# ---- finding 1's warning has the category too ------------------------------------------------


# ---- module state outside the state_dict (evidence for verify, and a warning) -----------------


class RunningNorm(torch.nn.Module):
    def __init__(self, hidden: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.register_buffer("mask", torch.ones(1), persistent=False)  # a constant: fine
        self.hidden = hidden
        if hidden:
            self.mean = torch.zeros(1)  # updated in forward, but not a buffer: never saved
        else:
            self.register_buffer("mean", torch.zeros(1))

    def forward(self, x):
        if self.hidden:
            self.mean = 0.9 * self.mean + 0.1 * x.mean().detach()
        else:
            self.mean.mul_(0.9).add_(0.1 * x.mean().detach())
        return self.lin(x - self.mean) * self.mask


@pytest.mark.parametrize("hidden", [True, False])
def test_module_state_outside_the_state_dict_that_training_changes_is_named(tmp_path, hidden):
    model = RunningNorm(hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = _run(tmp_path / "r", model=model, optimizer=opt, max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in run.loop(range(100)):
            model(torch.full((2, 1), float(x))).sum().backward()
            opt.step()
            run.step()
    found = [w for w in caught if issubclass(w.category, ResumeWarning)]
    if hidden:
        assert len(found) == 1 and "model.mean (a tensor attribute, not a buffer)" in str(
            found[0].message
        )
        events = unbroken.read_metrics(str(tmp_path / "r"), events=True)
        assert {"event": "audit", "check": "hidden_state", "names": ["model.mean"]}.items() <= [
            e for e in events if e.get("event") == "audit"
        ][0].items()
    else:
        assert found == []


def test_a_numpy_random_state_is_tracked_like_a_generator(tmp_path):
    # The hint for an untracked numpy RandomState says to pass it to Run: that must work.
    import numpy as np

    rs = np.random.RandomState(5)
    run = _run(tmp_path / "r", max_steps=2, noise=rs)
    for _ in run.loop(range(10)):
        rs.standard_normal(3)
        run.step()
    expected = rs.standard_normal(3)
    again = np.random.RandomState(0)
    _run(tmp_path / "r", max_steps=2, noise=again).close()
    assert (again.standard_normal(3) == expected).all()
