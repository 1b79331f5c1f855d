"""Run's arguments without traps: a RunConfig or keyword options (not both), components whose
names are options' names (through components=), option types checked, errors that name what
they concern (as attributes too)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import unbroken
from unbroken import EMA, ConfigError, CorruptCheckpointError, LockError, Run, RunConfig, StateError
from unbroken.errors import CheckpointNotFoundError, ConfigTypeError


class Counter:
    """A user's stateful component (a metrics accumulator, say)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


def test_a_run_config_is_accepted(tmp_path: Path) -> None:
    config = RunConfig(save_every=2, max_steps=4, progress=False)
    model = torch.nn.Linear(2, 1)
    run = Run(tmp_path, config=config, model=model)
    assert run.config is config
    for _ in range(4):
        run.step()
    run.finish()
    assert sorted(s for s, _ in unbroken.store.scan(str(tmp_path))) == [2, 4]


def test_config_and_keyword_options_at_once_is_an_error_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        Run(tmp_path, config=RunConfig(), model=torch.nn.Linear(2, 1), save_every=3, seed=1)
    msg = str(ei.value)
    assert "config=" in msg and "save_every=" in msg and "seed=" in msg, msg
    assert not os.path.exists(tmp_path / ".unbroken.lock")  # refused before touching the dir


def test_config_must_be_a_run_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigTypeError, match=r"components=\{'config': obj\}"):
        Run(tmp_path, config=Counter(), model=torch.nn.Linear(2, 1))


@pytest.mark.parametrize(
    "name, component",
    [
        ("metrics", Counter()),
        ("stage", torch.nn.Linear(2, 2)),
        ("seed", torch.Generator()),
        ("progress", Counter()),
    ],
)
def test_a_component_named_like_an_option_is_an_error_naming_both(
    tmp_path: Path, name: str, component: Any
) -> None:
    with pytest.raises(ConfigError) as ei:
        Run(tmp_path, model=torch.nn.Linear(2, 1), **{name: component})
    msg = str(ei.value)
    assert f"Run keyword {name!r}" in msg and f"RunConfig.{name}" in msg, msg
    assert type(component).__name__ in msg and f"components={{{name!r}: ...}}" in msg, msg


def test_components_argument_tracks_any_name(tmp_path: Path) -> None:
    def make() -> tuple[Run, Counter, torch.Generator]:
        metrics, seed = Counter(), torch.Generator().manual_seed(7)
        run = Run(
            tmp_path,
            model=torch.nn.Linear(2, 1),
            components={"metrics": metrics, "seed": seed},
            metrics=False,  # still the option: no metrics.jsonl
            progress=False,
        )
        return run, metrics, seed

    run, metrics, seed = make()
    assert {"metrics", "seed"} <= set(run.registry.names())
    metrics.n = 5
    torch.rand(3, generator=seed)
    state = seed.get_state()
    run.save()
    run.close()
    assert not (tmp_path / "metrics.jsonl").exists()
    run, metrics, seed = make()
    assert run.resumed_from == 0 and metrics.n == 5
    assert torch.equal(seed.get_state(), state)
    run.close()


def test_a_component_given_twice_is_an_error(tmp_path: Path) -> None:
    m = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="'model' is given twice"):
        Run(tmp_path, model=m, components={"model": m})


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("save_every", "10", "an int or None"),
        ("max_steps", 2.5, "an int or None"),
        ("metrics", "yes", "a bool"),
        ("save_every_minutes", "5", "a number or None"),
        ("allow_missing", "loader", "a list or tuple of component names"),
        ("on_save", 3, "a function"),
        ("resume", "latest", "True, False or a step number"),
    ],
)
def test_option_types_are_checked(tmp_path: Path, option: str, value: Any, expected: str) -> None:
    with pytest.raises(TypeError) as ei:
        Run(tmp_path, model=torch.nn.Linear(2, 1), **{option: value})
    assert isinstance(ei.value, ConfigTypeError) and isinstance(ei.value, ConfigError)
    msg = str(ei.value)
    assert f"Run option {option}= must be {expected}" in msg and repr(value) in msg, msg
    with pytest.raises(ConfigTypeError):
        RunConfig(**{option: value})


def test_range_errors_stay_value_errors() -> None:
    with pytest.raises(ConfigError, match="save_every must be a positive integer") as ei:
        RunConfig(save_every=0)
    assert not isinstance(ei.value, TypeError)


def test_the_ema_error_names_public_api_only() -> None:
    ema = EMA(torch.nn.Linear(2, 2))
    ema.model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(StateError) as ei:
        ema.update()
    msg = str(ei.value)
    assert "unbroken.train.Change(model=...)" in msg and "unbroken.EMA(model)" in msg, msg
    assert "grow_ema" not in msg and "gone: ['bias', 'weight']" in msg, msg


def test_errors_carry_the_path_and_step_they_concern(tmp_path: Path) -> None:
    run = Run(tmp_path, model=torch.nn.Linear(2, 1), progress=False)
    run.step()
    run.save()
    with pytest.raises(LockError) as lock_err:
        Run(tmp_path, model=torch.nn.Linear(2, 1), progress=False)
    assert lock_err.value.path == str(tmp_path)
    run.close()
    store = unbroken.store.CheckpointStore(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError) as missing:
        store.open(7)
    assert missing.value.step == 7 and missing.value.path.endswith("step-000000007")
    ckpt = os.path.join(str(tmp_path), "checkpoints", "step-000000001")
    with open(os.path.join(ckpt, "state.json"), "a") as f:
        f.write(" ")  # one byte more than the manifest says
    with pytest.raises(CorruptCheckpointError) as bad:
        unbroken.CheckpointReader(ckpt).verify()
    assert bad.value.step == 1 and bad.value.path is not None
    assert bad.value.path.startswith(ckpt), bad.value.path
