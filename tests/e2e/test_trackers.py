"""Trackers after resumes: TensorBoard's own event reader sees each step exactly once after two
interruptions in separate processes (SIGKILL, then SIGTERM); the W&B run id is one per
training run, across processes, and made once even by racing first launches."""

from __future__ import annotations

import multiprocessing
import os
import textwrap
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import unbroken
from tests.golden import assert_identical, launch, run_interrupted

SCRIPT = textwrap.dedent(
    """
    import argparse, os, signal
    import torch
    import unbroken

    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--signal", default="KILL")
    a = p.parse_args()
    unbroken.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = unbroken.MapLoader(data, batch_size=8, shuffle=True, seed=0)
    run = unbroken.Run(a.run_dir, model=model, optimizer=opt, loader=loader,
                       save_every=4, max_steps=14, progress=False)
    writer = unbroken.integrations.tensorboard_writer(run)
    for x, y in run.loop(loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # Before run.step(): a stop saves and exits inside it, after which nothing would log
        # the step it completed (and the resumed run does not redo it).
        writer.add_scalar("loss", loss.item(), run.counters.step + 1)
        writer.flush()  # on disk before a SIGKILL: the events of the steps to be redone
        run.step(loss=loss)
        if run.counters.step == a.signal_at:
            os.kill(os.getpid(), getattr(signal, "SIG" + a.signal))
    writer.close()
    """
)


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "tb_train.py"
    path.write_text(SCRIPT)
    return path


def scalars(run_dir: Path, purge: bool = True) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"), purge_orphaned_data=purge)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")]


def test_tensorboard_shows_each_step_once_after_two_interruptions(
    script: Path, tmp_path: Path
) -> None:
    ref, inter = tmp_path / "ref", tmp_path / "inter"
    assert launch(script, ["--run-dir", str(ref)]) == 0
    # SIGKILL after step 6 (checkpoint 4: steps 5-6 are redone), SIGTERM after step 11 (saves
    # at its stop), then to the end: three launches, three event files in one directory.
    run_interrupted(script, [], inter, [(6, "KILL"), (11, "TERM")])
    assert len(list((inter / "tensorboard").iterdir())) == 3
    assert_identical(ref, inter)
    expected = scalars(ref)
    assert [s for s, _ in expected] == list(range(1, 15))
    assert scalars(inter) == expected  # each step once, with the uninterrupted values
    logged = [r["loss"] for r in unbroken.read_metrics(str(ref))]
    assert [v for _, v in expected] == pytest.approx(logged, rel=1e-6)  # float32 in events
    # The control: the files do hold steps 5 and 6 twice (logged before the SIGKILL, redone
    # after it); the purge marks are what hides the first copies. (Step 12, saved by the
    # SIGTERM stop, is not redone.)
    raw = sorted(s for s, _ in scalars(inter, purge=False))
    assert raw == sorted([*range(1, 15), 5, 6])


def test_purge_step_is_the_first_step_this_launch_logs(tmp_path: Path) -> None:
    import torch

    model = torch.nn.Linear(2, 1)
    run = unbroken.Run(tmp_path, model=model, progress=False)
    assert (
        unbroken.integrations.tensorboard_purge_step(run) == 1
    )  # fresh: a killed first launch's events go
    for _ in range(3):
        run.step()
    run.save()
    run.close()
    again = unbroken.Run(tmp_path, model=torch.nn.Linear(2, 1), progress=False)
    assert again.resumed_from == 3 and unbroken.integrations.tensorboard_purge_step(again) == 4
    with pytest.raises(unbroken.ConfigError, match="purge_step"):
        unbroken.integrations.tensorboard_writer(again, purge_step=1)
    again.close()


# ---- W&B --------------------------------------------------------------------------------------


def _id_in_child(run_dir: str, start: object, out: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    out.put(unbroken.integrations.wandb_run_id(run_dir))  # type: ignore[attr-defined]


def test_wandb_id_is_stable_across_processes_and_races(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")  # real processes; no re-import
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_id_in_child, args=(str(tmp_path), start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()  # four first launches at once
    ids = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(ids) == 1
    (run_id,) = ids
    assert run_id.isalnum() and 8 <= len(run_id) <= 64
    assert (tmp_path / "wandb-run-id").read_text().strip() == run_id
    assert sorted(os.listdir(tmp_path)) == ["wandb-run-id"]  # no temporary file left
    args = unbroken.integrations.wandb_init_args(tmp_path, project="p", config={"lr": 1})
    assert args == {"id": run_id, "resume": "allow", "project": "p", "config": {"lr": 1}}
    assert (
        unbroken.integrations.wandb_run_id(tmp_path / "other") != run_id
    )  # another run, another id


def test_wandb_args_refuse_what_they_set_and_a_bad_id_file(tmp_path: Path) -> None:
    with pytest.raises(unbroken.ConfigError, match="resume"):
        unbroken.integrations.wandb_init_args(tmp_path, resume="never")
    (tmp_path / "wandb-run-id").write_text("not an id!\n")
    with pytest.raises(unbroken.ConfigError, match="wandb-run-id does not hold a W&B run id"):
        unbroken.integrations.wandb_init_args(tmp_path)
