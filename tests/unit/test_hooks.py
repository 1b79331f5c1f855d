"""on_save / on_resume: the user's own loggers hear of each durable checkpoint and each
restore, with (step, path), in the training thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken import Run, RunConfig


def _train(run: Run, model: torch.nn.Module, steps: int) -> None:
    opt = run.optimizer
    for _ in range(steps):
        loss = model(torch.ones(2, 3)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.step(loss=loss)


@pytest.mark.parametrize("async_save", [False, True])
def test_on_save_hears_each_committed_checkpoint_in_the_training_thread(
    tmp_path: Path, async_save: bool
) -> None:
    heard: list[tuple[int, str]] = []

    def on_save(step: int, path: str) -> None:
        assert threading.current_thread() is threading.main_thread()
        unbroken.CheckpointReader(path).verify()  # committed and whole when we hear of it
        heard.append((step, path))

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = RunConfig(
        save_every=2, max_steps=6, keep_last=None, async_save=async_save, on_save=on_save,
        progress=False,
    )  # fmt: skip
    run = Run(tmp_path, config=config, model=model, optimizer=opt)
    _train(run, model, 6)
    run.finish()
    root = tmp_path / "checkpoints"
    assert heard == [(s, str(root / f"step-{s:09d}")) for s in (2, 4, 6)]


def test_on_resume_is_called_after_every_component_is_restored(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = Run(tmp_path, model=model, optimizer=opt, save_every=3, progress=False)
    _train(first, model, 3)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    first.close()

    fresh = torch.nn.Linear(3, 1)
    heard: list[tuple[int, str, bool]] = []

    def on_resume(step: int, path: str) -> None:
        restored = all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
        heard.append((step, path, restored))

    again = Run(
        tmp_path,
        model=fresh,
        optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1),
        on_resume=on_resume,
        progress=False,
    )
    again.close()
    assert heard == [(3, str(tmp_path / "checkpoints" / "step-000000003"), True)]


def test_on_resume_is_not_called_on_a_fresh_start(tmp_path: Path) -> None:
    heard: list[int] = []
    run = Run(
        tmp_path, model=torch.nn.Linear(1, 1), on_resume=lambda s, p: heard.append(s),
        progress=False,
    )  # fmt: skip
    run.close()
    assert heard == []


def test_on_resume_leaves_the_restored_random_streams_alone(tmp_path: Path) -> None:
    import random

    import numpy as np

    run = Run(tmp_path, model=torch.nn.Linear(1, 1), save_every=1, progress=False)
    run.step()
    run.close()

    def draws() -> tuple[float, float, float]:
        return torch.rand(()).item(), random.random(), float(np.random.random())

    def greedy(step: int, path: str) -> None:
        draws()  # a logger that draws random numbers (an id, a sample) while resuming

    plain = Run(tmp_path, model=torch.nn.Linear(1, 1), progress=False)
    want = draws()
    plain.close()
    hooked = Run(tmp_path, model=torch.nn.Linear(1, 1), on_resume=greedy, progress=False)
    assert draws() == want
    hooked.close()
