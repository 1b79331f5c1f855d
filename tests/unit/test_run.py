"""The run API in one process: required state, save triggers, streams, metrics, EMA, scaler, lock.

Each test drives a real :class:`unbroken.Run` (real saves, real loads) on a tiny model; the
signal tests, which need a separate process, are in ``test_run_signals.py``.
"""

from __future__ import annotations

import math
import os
import random
import re
import signal
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import unbroken
from tests._logs import logged
from tests.process.test_run_signals import Child
from unbroken import EMA, ConfigError, LockError, Run, RunConfig, StateError, read_metrics
from unbroken.errors import CheckpointNotFoundError
from unbroken.store import CheckpointReader, CheckpointStore, scan
from unbroken.train import _checkpointer as checkpointer_module
from unbroken.train import _run as run_module

# ---- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def runs() -> Iterator[Callable[..., Run]]:
    """Make Runs (progress off) and close whichever a failing test left open."""
    opened: list[Run] = []

    def make(run_dir: Path, **kwargs: Any) -> Run:
        kwargs.setdefault("progress", False)
        run = Run(run_dir, **kwargs)
        opened.append(run)
        return run

    yield make
    for run in opened:
        run.close()


def _net(width: int = 4, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A model (a fixed body and a head of ``width`` outputs) and its optimizer."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(3, 3), "head": torch.nn.Linear(3, width)})
    model.to(dtype)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def _steps(run_dir: Path) -> list[int]:
    """Steps of the committed checkpoints, oldest first."""
    return sorted(s for s, _ in scan(str(run_dir)))


def _reader(run_dir: Path, step: int) -> CheckpointReader:
    return CheckpointStore(str(run_dir)).open(step)


def _counters(run_dir: Path, step: int) -> dict[str, Any]:
    return _reader(run_dir, step).global_trees()["counters"]


def _saved_once(run_dir: Path, **components: Any) -> None:
    """A checkpoint at step 1 of ``_net()`` plus ``components``."""
    run = Run(run_dir, **_net(), **components, progress=False, save_final=False)
    run.step()
    run.save()
    run.close()


def _count_saves(run: Run) -> list[int]:
    """Record the step of every save the run makes."""
    saved: list[int] = []
    original = run.save

    def save(**kw: object) -> str:
        saved.append(run.counters.step)
        return original(**kw)  # type: ignore[arg-type]

    run.save = save  # type: ignore[method-assign]
    return saved


def _loader(n: int, batch_size: int) -> unbroken.MapLoader:
    data = torch.utils.data.TensorDataset(torch.arange(float(n)).unsqueeze(1))
    return unbroken.MapLoader(data, batch_size=batch_size, shuffle=False)


# ---- 1. required state and keywords -----------------------------------------------------------


def test_component_missing_from_checkpoint_is_named_and_allow_missing_starts_it_fresh(
    tmp_path, runs
):
    d = tmp_path / "run"
    _saved_once(d)
    with pytest.raises(StateError, match=r"\['noise'\].*allow_missing"):
        runs(d, **_net(), noise=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    run = runs(d, **_net(), noise=gen, allow_missing=("noise",))
    assert run.resumed_from == 1
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(5).get_state())


def test_component_only_in_checkpoint_is_named_and_allow_unexpected_ignores_it(tmp_path, runs):
    d = tmp_path / "run"
    _saved_once(d, noise=torch.Generator().manual_seed(5))
    with pytest.raises(StateError, match=r"\['noise'\].*not tracked now.*allow_unexpected"):
        runs(d, **_net())
    run = runs(d, **_net(), allow_unexpected=("noise",))
    assert run.resumed_from == 1


def test_tensor_shape_change_names_component_and_tensor(tmp_path, runs):
    d = tmp_path / "run"
    _saved_once(d)
    with pytest.raises(StateError) as ei:
        runs(d, **_net(width=8))
    msg = str(ei.value)
    assert re.search(r"model: tensor 'head\.(weight|bias)' has shape \[8.*\] now", msg), msg
    assert "[4" in msg
    # The failed start released the lock: the right model resumes.
    assert runs(d, **_net()).resumed_from == 1


def test_tensor_dtype_change_names_component_tensor_and_dtypes(tmp_path, runs):
    d = tmp_path / "run"
    _saved_once(d)
    with pytest.raises(StateError) as ei:
        runs(d, **_net(dtype=torch.float64))
    msg = str(ei.value)
    assert re.search(r"model: tensor '\w+\.(weight|bias)'", msg), msg
    assert "torch.float64 now but torch.float32 in the checkpoint" in msg


@pytest.mark.parametrize("keyword", ["save_evry", "lr"])
def test_unknown_keyword_is_a_config_error_naming_it(tmp_path, keyword):
    d = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"'{keyword}'"):
        Run(d, **_net(), **{keyword: 5})
    assert not d.exists(), "a rejected Run must not touch the run directory"


def test_mistyped_option_suggests_the_option(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'save_every'"):
        Run(tmp_path / "run", **_net(), save_evry=5)


@pytest.mark.parametrize("name", ["counters", "rng"])
def test_reserved_component_names(tmp_path, name):
    with pytest.raises(ConfigError, match=f"'{name}' is reserved"):
        Run(tmp_path / "run", **_net(), **{name: torch.Generator()})


def test_time_limit_accepts_slurm_notation():
    assert RunConfig(time_limit="1-02:03:04").time_limit_seconds() == 93784.0
    assert RunConfig(time_limit="05:00").time_limit_seconds() == 300.0
    with pytest.raises(ConfigError, match="time_limit"):
        RunConfig(time_limit="soon")


# ---- 2. save triggers -------------------------------------------------------------------------


def test_save_every_saves_exactly_at_multiples(tmp_path, runs):
    d = tmp_path / "run"
    run = runs(d, **_net(), save_every=3, keep_last=None, save_final=False)
    new_per_step = []
    for _ in range(10):
        before = set(_steps(d))
        run.step()
        new_per_step.append(sorted(set(_steps(d)) - before))
    assert new_per_step == [[], [], [3], [], [], [6], [], [], [9], []]
    run.finish()
    assert _steps(d) == [3, 6, 9], "save_final=False must not save at finish()"


def test_max_steps_completes_with_one_final_save(tmp_path, runs):
    d = tmp_path / "run"
    run = runs(d, **_net(), save_every=3, keep_last=None, max_steps=7)
    saves = _count_saves(run)
    done = [run.step() for _ in range(7)]
    assert done == [False] * 6 + [True]
    run.finish()
    assert saves == [3, 6, 7], "finish() after a final save must not save again"
    assert _steps(d) == [3, 6, 7]
    assert _counters(d, 7)["complete"] is True
    assert _counters(d, 6)["complete"] is False


def test_save_every_minutes_uses_wall_time_since_the_last_save(tmp_path, runs, monkeypatch):
    clock = [1000.0]
    fake = types.SimpleNamespace(time=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(run_module, "time", fake)
    monkeypatch.setattr(checkpointer_module, "time", fake)
    d = tmp_path / "run"
    run = runs(d, **_net(), save_every_minutes=1, keep_last=None, save_final=False)
    for _ in range(10):
        clock[0] += 25.0
        run.step()
    # 25 s per step: due once 60 s passed since the start or the previous save.
    assert _steps(d) == [3, 6, 9]


def test_save_on_epoch_end_with_epochs(tmp_path, runs):
    d = tmp_path / "run"
    loader = _loader(12, 4)
    run = runs(d, **_net(), loader=loader, save_on_epoch_end=True, keep_last=None)
    saves = _count_saves(run)
    at_start = []
    for epoch in run.epochs(3):
        at_start.append((epoch, run.last_saved_step))
        for _ in loader:
            run.step()
    assert at_start == [(0, None), (1, 3), (2, 6)]
    assert saves == [3, 6, 9], "the last epoch's end and the final save are one save"
    assert _steps(d) == [3, 6, 9]
    for step, epoch in ((3, 1), (6, 2), (9, 3)):
        assert _reader(d, step).meta["epoch"] == epoch
        loader_state = _reader(d, step).global_trees()["loader"]
        assert (loader_state["epoch"], loader_state["position"]) == (epoch - 1, 12)
    assert _counters(d, 9)["complete"] is True


def test_save_on_epoch_end_with_loop(tmp_path, runs):
    d = tmp_path / "run"
    loader = _loader(8, 4)
    run = runs(d, **_net(), loader=loader, save_on_epoch_end=True, keep_last=None)
    saves = _count_saves(run)
    for _ in run.loop(loader, epochs=3):
        run.step()
    # Epoch ends at 2 and 4; the end of the last epoch is the final save.
    assert saves == [2, 4, 6]
    assert _steps(d) == [2, 4, 6]
    assert _counters(d, 6)["complete"] is True


def test_epoch_end_save_waits_for_an_accumulation_window_spanning_the_boundary(tmp_path, runs):
    # 10 samples, batch 4: 3 batches per epoch; 2 batches per optimizer step.
    d = tmp_path / "run"
    loader = _loader(10, 4)
    run = runs(d, **_net(), loader=loader, save_on_epoch_end=True, keep_last=None)
    log = []
    micro = 0
    for _epoch in run.epochs(3):
        for _ in loader:
            micro += 1
            if micro == 2:
                micro = 0
                run.step()
                log.append((run.counters.step, run.last_saved_step))
    # Epoch 0 ends with batch 3 drawn but not stepped: its save waits for step 2.
    # Epoch 1 ends right after step 3: saved at once.
    assert log == [(1, None), (2, 2), (3, 2), (4, 3)]
    assert _steps(d) == [2, 3, 4]
    at2 = _reader(d, 2).global_trees()
    assert at2["counters"]["epoch"] == 1
    assert (at2["loader"]["epoch"], at2["loader"]["position"]) == (1, 4)


def _slow_steps(run: Run, seconds: float = 0.05, limit: int = 200) -> None:
    for _ in range(limit):
        time.sleep(seconds)
        run.step(loss=1.0)
    raise AssertionError(f"the run did not stop within {limit} steps")


def test_time_limit_saves_and_exits_75_before_the_budget(tmp_path, runs, monkeypatch):
    d = tmp_path / "run"
    start = time.time()
    # The budget counts from the process's start (tests/process/test_hardening_signals.py checks
    # that in a fresh process); this long-lived test process starts it now instead.
    monkeypatch.setattr("unbroken.train._run.process_start", lambda: start)
    # Seconds of slack, not tenths: a loaded machine can deschedule a step or stretch the stop
    # save by a few hundred ms, and the promise tested is "before the budget", not "at once".
    run = runs(d, **_net(), time_limit=6, time_margin=2)
    # The stop is a WARNING record (stderr through logging.lastResort in a plain process:
    # tests/process/test_run_signals.py and tests/process/test_logging.py read it there).
    with logged() as said, pytest.raises(SystemExit) as ei:
        _slow_steps(run)
    assert ei.value.code == unbroken.EXIT_RESUMABLE == 75
    assert time.time() < start + 6, "stopped after the budget ended"
    stop = run.counters.step
    assert stop >= 5, f"stopped at step {stop}, long before the budget required"
    assert _steps(d) == [stop]
    assert _counters(d, stop)["complete"] is False
    err = "\n".join(said)
    assert f"stopped at step {stop} (time limit)" in err and "relaunch" in err
    events = [m for m in read_metrics(str(d), events=True) if "event" in m]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "time limit"
    assert events[-1]["step"] == stop
    # The lock was released: relaunching continues from the stop step.
    assert runs(d, **_net()).resumed_from == stop


def test_slurm_job_end_time_is_a_deadline(tmp_path, runs, monkeypatch):
    end = math.ceil(time.time()) + 4  # whole seconds, as SLURM gives it; slack as above
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(end))
    d = tmp_path / "run"
    run = runs(d, **_net(), time_margin=1.5)
    with logged() as said, pytest.raises(SystemExit) as ei:
        _slow_steps(run)
    assert ei.value.code == 75
    assert time.time() < end
    assert _steps(d) == [run.counters.step]
    assert any("(time limit)" in m for m in said), said


def test_finish_saves_a_final_checkpoint_and_releases_the_lock(tmp_path, runs):
    d = tmp_path / "run"
    run = runs(d, **_net())
    for _ in range(3):
        run.step()
    assert _steps(d) == []
    run.finish()
    run.finish()  # idempotent
    assert _steps(d) == [3]
    assert _counters(d, 3)["complete"] is True
    again = runs(d, **_net())
    assert again.resumed_from == 3 and again.done


@pytest.mark.parametrize("style", ["loop", "epochs"])
def test_end_of_iteration_saves_the_final_step(tmp_path, runs, style):
    d = tmp_path / "run"
    loader = _loader(8, 4)
    run = runs(d, **_net(), loader=loader)
    if style == "loop":
        for _ in run.loop(loader, epochs=2):
            run.step()
    else:
        for _ in run.epochs(2):
            for _ in loader:
                run.step()
    assert _steps(d) == [4]
    assert _counters(d, 4)["complete"] is True
    assert _counters(d, 4)["epoch"] == 2


def test_resume_from_an_explicit_step_moves_newer_checkpoints_aside(tmp_path, runs):
    d = tmp_path / "run"
    first = runs(d, **_net(), save_every=2, keep_last=None)
    for _ in range(8):
        first.step(loss=1.0)
    first.finish()
    assert _steps(d) == [2, 4, 6, 8]
    with logged() as said:
        run = runs(d, **_net(), save_every=2, keep_last=None, resume=4)
    assert any("moved aside" in m for m in said), said
    assert run.resumed_from == 4 and run.counters.step == 4 and not run.done
    aside = sorted(n for n in os.listdir(d / "checkpoints") if n.startswith("superseded-"))
    assert [n.split("-")[2] for n in aside] == ["000000006", "000000008"]
    for name in aside:
        CheckpointReader(str(d / "checkpoints" / name)).verify()  # kept intact
    assert _steps(d) == [2, 4]
    run.step(loss=2.0)
    run.step(loss=2.0)
    run.close()
    assert _steps(d) == [2, 4, 6]
    assert len([n for n in os.listdir(d / "checkpoints") if n.startswith("superseded-")]) == 2
    assert [(m["step"], m["loss"]) for m in read_metrics(str(d))] == [
        (1, 1.0),
        (2, 1.0),
        (3, 1.0),
        (4, 1.0),
        (5, 2.0),
        (6, 2.0),
    ]


def test_resume_from_a_step_that_was_not_saved(tmp_path, runs):
    d = tmp_path / "run"
    _saved_once(d)
    with pytest.raises(CheckpointNotFoundError, match="step 5"):
        runs(d, **_net(), resume=5)
    assert runs(d, **_net()).resumed_from == 1


def test_resume_false_refuses_a_directory_with_checkpoints(tmp_path, runs):
    d = tmp_path / "run"
    fresh = runs(d, **_net(), resume=False)
    assert fresh.resumed_from is None
    fresh.step()
    fresh.finish()
    with pytest.raises(ConfigError, match="resume=False"):
        runs(d, **_net(), resume=False)
    assert runs(d, **_net()).resumed_from == 1


def test_relaunching_a_completed_run_does_no_more_steps(tmp_path, runs):
    # Completed by its epochs (no max_steps): only the saved `complete` flag says it is done.
    d = tmp_path / "run"
    loader = _loader(8, 4)
    run = runs(d, **_net(), loader=loader)
    for _ in run.epochs(2):
        for _ in loader:
            run.step()
    assert _steps(d) == [4]
    manifest = d / "checkpoints" / "step-000000004" / "manifest.json"
    mtime = manifest.stat().st_mtime_ns

    loader = _loader(8, 4)
    again = runs(d, **_net(), loader=loader)
    saves = _count_saves(again)
    assert again.done and again.counters.step == 4
    assert list(again.epochs(2)) == []
    assert list(again.loop(loader, epochs=3)) == []
    again.finish()
    assert saves == [] and _steps(d) == [4]
    assert manifest.stat().st_mtime_ns == mtime
    assert [m["step"] for m in read_metrics(str(d))] == [1, 2, 3, 4]


# ---- 3. saving perturbs no stream -------------------------------------------------------------


def _stream_states(gen: torch.Generator, npgen: np.random.Generator) -> list[Any]:
    np_state = np.random.get_state()
    return [
        random.getstate(),
        (np_state[0], np_state[1].tolist(), *np_state[2:]),
        torch.get_rng_state().tolist(),
        gen.get_state().tolist(),
        repr(npgen.bit_generator.state),
    ]


def _draw(gen: torch.Generator, npgen: np.random.Generator) -> list[float]:
    return [
        random.random(),
        float(np.random.rand()),
        *torch.rand(2).tolist(),
        *torch.rand(2, generator=gen).tolist(),
        float(npgen.random()),
    ]


def test_save_leaves_every_stream_where_it_was(tmp_path, runs):
    gen, npgen = torch.Generator().manual_seed(1), np.random.default_rng(2)
    run = runs(tmp_path / "run", **_net(), gen=gen, npgen=npgen, seed=3)
    _draw(gen, npgen)
    run.step()
    before = _stream_states(gen, npgen)
    run.save()
    assert _stream_states(gen, npgen) == before


def _train_with_streams(run_dir: Path, save_every: int | None) -> tuple[list[Any], Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen, npgen = torch.Generator().manual_seed(1), np.random.default_rng(2)
    loader = unbroken.MapLoader(
        torch.utils.data.TensorDataset(torch.randn(12, 3)), batch_size=4, seed=4
    )
    run = Run(
        run_dir,
        model=model,
        optimizer=opt,
        gen=gen,
        npgen=npgen,
        loader=loader,
        seed=3,
        save_every=save_every,
        save_final=False,
        keep_last=None,
        progress=False,
    )
    out: list[Any] = []
    try:
        for (x,) in run.loop(loader, epochs=2):
            noise = torch.randn(x.shape, generator=gen) + torch.from_numpy(
                npgen.normal(size=x.shape)
            )
            loss = model(x + noise.float()).pow(2).mean() * (1 + random.random())
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.step(loss=loss)
            out.append([loss.item(), *_draw(gen, npgen)])
    finally:
        run.close()
    return out, [p.detach().clone() for p in model.parameters()]


def test_training_that_saves_every_step_equals_training_that_never_saves(tmp_path):
    saving, w_saving = _train_with_streams(tmp_path / "a", save_every=1)
    plain, w_plain = _train_with_streams(tmp_path / "b", save_every=None)
    assert _steps(tmp_path / "a") == [1, 2, 3, 4, 5, 6]
    assert _steps(tmp_path / "b") == []
    assert saving == plain
    assert all(torch.equal(a, b) for a, b in zip(w_saving, w_plain, strict=True))


# ---- 5. metrics log ---------------------------------------------------------------------------


def test_metrics_log_one_record_per_step_across_abandoned_runs(tmp_path, runs):
    d = tmp_path / "run"
    # Two processes' worth of work that stop past their last checkpoint (like kill -9: the
    # lines after the checkpoint were written and flushed), then one that completes.
    for attempt, (first, last) in enumerate(((1, 5), (4, 8))):
        run = runs(d, **_net(), save_every=3)
        assert run.counters.step == first - 1
        for step in range(first, last + 1):
            run.step(loss=100.0 * (attempt + 1) + step)
        run.close()
        assert [m["step"] for m in read_metrics(str(d))][-1] == last
    run = runs(d, **_net(), save_every=3, max_steps=10)
    assert run.resumed_from == 6
    for step in range(7, 11):
        run.step(loss=float(step))
    run.finish()

    records = read_metrics(str(d))
    assert [m["step"] for m in records] == list(range(1, 11))
    assert all("event" not in m for m in records)
    losses = [m["loss"] for m in records]
    assert losses == [101, 102, 103, 204, 205, 206, 7, 8, 9, 10]
    everything = read_metrics(str(d), events=True)
    resumes = [m["step"] for m in everything if m.get("event") == "resume"]
    assert resumes == [3, 6]
    order = [m.get("step") if "event" not in m else ("resume", m["step"]) for m in everything]
    assert order == [1, 2, 3, ("resume", 3), 4, 5, 6, ("resume", 6), 7, 8, 9, 10]


# ---- 6. progress bar --------------------------------------------------------------------------


def test_progress_bar_shows_steps_and_next_save(tmp_path, capsys, runs):
    run = runs(tmp_path / "run", **_net(), progress=True, save_every=4, max_steps=10)
    for _ in range(8):
        run.step(loss=0.5)
    run._progress._bar.refresh()  # tqdm redraws on a timer: draw the state after step 8 now
    err = capsys.readouterr().err
    assert "next save in 2 steps" in err  # the final save at 10 comes before step 12's
    for _ in range(2):
        run.step(loss=0.5)
    run.finish()
    err += capsys.readouterr().err
    assert "10/10" in err
    assert "loss=0.5" in err


def test_progress_bar_of_epochs_has_a_total_and_shows_time_triggers(tmp_path, capsys, runs):
    # No max_steps: the total comes from the epochs (3 x 5 batches), so tqdm can show an ETA;
    # the time-based save and the time limit show how far away they are.
    loader = unbroken.MapLoader(list(range(20)), batch_size=4, seed=0)
    run = runs(
        tmp_path / "run",
        **_net(),
        loader=loader,
        progress=True,
        save_every_minutes=30,
        time_limit="2:00:00",
    )
    for _ in run.epochs(3):
        for _batch in loader:
            run.step(loss=0.5)
    err = capsys.readouterr().err
    assert "15/15" in err
    assert re.search(r"next save in (29\.\d|30\.0) min", err), err[-500:]
    assert re.search(r"stop and save in 1[12]\d\.\d min", err), err[-500:]


@pytest.mark.parametrize("progress", [False, None], ids=["off", "default-not-a-tty"])
def test_no_progress_output_when_off(tmp_path, capsys, runs, progress):
    run = runs(tmp_path / "run", **_net(), progress=progress, save_every=4, max_steps=10)
    for _ in range(10):
        run.step(loss=0.5)
    run.finish()
    assert capsys.readouterr().err == ""


# ---- 7. EMA -----------------------------------------------------------------------------------


def _set(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def test_ema_applied_swaps_in_the_average_and_restores_the_raw_weights_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ema = EMA(model, decay=0.9)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(5, 3))  # moves the BatchNorm buffers
        ema.update()
    params = list(model.parameters())
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(raw[k], ema.shadow[k]) for k in raw)
    with ema.applied() as m:
        assert m is model
        for k, v in model.state_dict().items():
            assert torch.equal(v, ema.shadow[k]), k
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw[k]), k
    assert list(model.parameters()) == params, "parameters must stay the same objects"
    with pytest.raises(RuntimeError, match="boom"), ema.applied():
        raise RuntimeError("boom")
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw[k]), k


def test_ema_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    a = torch.nn.Linear(3, 4)
    b = torch.nn.Linear(3, 4)
    b.load_state_dict(a.state_dict())
    ema_a = EMA(a, decay=0.8)
    for _ in range(2):
        _set(a, float(torch.rand(())))
        ema_a.update()
    ema_b = EMA(b, decay=0.8)
    ema_b.load_state_dict(ema_a.state_dict())
    assert ema_b.updates == 2
    assert all(torch.equal(ema_a.shadow[k], ema_b.shadow[k]) for k in ema_a.shadow)
    b.load_state_dict(a.state_dict())
    for value in (0.25, 3.0):
        _set(a, value)
        _set(b, value)
        ema_a.update()
        ema_b.update()
    assert all(torch.equal(ema_a.shadow[k], ema_b.shadow[k]) for k in ema_a.shadow)
    with pytest.raises(StateError, match="version"):
        ema_b.load_state_dict({**ema_a.state_dict(), "version": 99})


def test_ema_is_restored_exactly_by_a_run(tmp_path, runs):
    d = tmp_path / "run"
    net = _net()
    ema = EMA(net["model"], decay=0.5)
    run = runs(d, **net, ema=ema)
    _set(net["model"], 2.0)
    ema.update()
    run.step()
    run.finish()
    again_net = _net()
    again_ema = EMA(again_net["model"], decay=0.5)
    runs(d, **again_net, ema=again_ema)
    assert again_ema.updates == 1
    assert all(torch.equal(ema.shadow[k], again_ema.shadow[k]) for k in ema.shadow)


def test_ema_decay_may_be_a_function_of_the_update_count():
    model = torch.nn.Linear(2, 2)
    _set(model, 0.0)
    seen: list[int] = []

    def decay(n: int) -> float:
        seen.append(n)
        return [0.5, 0.75][n]

    ema = EMA(model, decay=decay)
    _set(model, 8.0)
    ema.update()  # 0 + 0.5 * 8
    assert all(torch.all(v == 4.0) for v in ema.shadow.values())
    ema.update()  # 4 + 0.25 * 4
    assert all(torch.all(v == 5.0) for v in ema.shadow.values())
    assert seen == [0, 1] and ema.updates == 2
    with pytest.raises(ConfigError, match="decay"):
        EMA(model, decay=1.5)


# ---- 8. GradScaler ----------------------------------------------------------------------------

_INF_STEPS = {2}


def _scaler_run(run_dir: Path, until: int) -> torch.amp.GradScaler:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    run = Run(run_dir, model=model, optimizer=opt, scaler=scaler, save_every=4, progress=False)
    try:
        while run.counters.step < until:
            step = run.counters.step + 1
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            if step in _INF_STEPS:
                loss = loss * math.inf  # an overflow: the scaler skips the step and backs off
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            tracker = int(scaler._get_growth_tracker())
            run.step(loss=loss, scale=scaler.get_scale(), tracker=tracker)
    finally:
        run.close()
    return scaler


def test_grad_scaler_scale_and_growth_tracker_survive_resume(tmp_path):
    ref = _scaler_run(tmp_path / "ref", 10)
    # Stop at 6 (past the checkpoint at 4, where the growth tracker is mid-interval),
    # then resume with fresh objects from step 4.
    _scaler_run(tmp_path / "cut", 6)
    assert _counters(tmp_path / "cut", 4)["step"] == 4
    assert _reader(tmp_path / "cut", 4).global_trees()["scaler"]["_growth_tracker"] == 2
    resumed = _scaler_run(tmp_path / "cut", 10)
    assert resumed.get_scale() == ref.get_scale()
    assert resumed._get_growth_tracker() == ref._get_growth_tracker()
    history = read_metrics(str(tmp_path / "ref"))
    assert len({m["scale"] for m in history}) >= 3, "the scale should back off and grow"
    assert history == read_metrics(str(tmp_path / "cut"))


# ---- 9. lock ----------------------------------------------------------------------------------

_HOLDER = """
import sys, time
import torch, unbroken
run = unbroken.Run(sys.argv[1], model=torch.nn.Linear(1, 1), progress=False)
print("ready", flush=True)
time.sleep(120)
"""


def test_second_run_in_another_process_gets_a_lock_error_naming_the_holder(tmp_path):
    d = tmp_path / "run"
    with Child(["-c", _HOLDER, str(d)]) as holder:
        holder.wait_for("ready")
        with pytest.raises(LockError) as ei:
            Run(d, model=torch.nn.Linear(1, 1), progress=False)
        assert f"pid {holder.pid}" in str(ei.value)
        assert str(d) in str(ei.value)
        os.kill(holder.pid, signal.SIGKILL)
        assert holder.finish() == -signal.SIGKILL
    with logged() as caught:
        run = Run(d, model=torch.nn.Linear(1, 1), progress=False)
    run.close()
    assert any(f"pid {holder.pid}" in m for m in caught), caught


def test_second_run_in_the_same_process_gets_a_lock_error(tmp_path, runs):
    d = tmp_path / "run"
    runs(d, **_net())
    with pytest.raises(LockError, match=f"pid {os.getpid()}"):
        Run(d, **_net())


def test_a_missing_rank_state_is_an_error_not_a_new_rank(tmp_path: Path) -> None:
    """A rank beyond the saved world size is new (seeded from (step, rank)); a rank within it
    whose state file is gone makes the checkpoint corrupt."""
    from tests._store_helpers import read_manifest_raw, write_manifest_raw
    from unbroken.train._resume import Resumer

    run = Run(tmp_path, model=torch.nn.Linear(2, 2), progress=False)
    run.save()
    run.close()
    ckpt = tmp_path / "checkpoints" / "step-000000000"
    m = read_manifest_raw(str(ckpt))
    m["files"].pop("rank-00000.json")
    write_manifest_raw(str(ckpt), m)
    with (
        logged() as said,
        pytest.raises(unbroken.CorruptCheckpointError, match="none of the 1 checkpoint"),
    ):
        unbroken.store.CheckpointStore(str(tmp_path)).latest()
    assert any("does not list rank-00000.json" in m for m in said), said
    # The run's own check, should a reader get past the store's.
    reader = unbroken.CheckpointReader(str(ckpt))
    run = Run(tmp_path / "other", model=torch.nn.Linear(2, 2), progress=False)
    with pytest.raises(unbroken.CorruptCheckpointError, match="no state of rank 0"):
        Resumer(
            run.store, run.config, run.registry, run.counters, 0, 1, None, lambda m, r: None
        )._prepare(reader)
    run.close()


class _NoBatches:
    """A loader whose every epoch is empty."""

    epoch = 0

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_a_loader_with_empty_epochs_is_an_error_not_a_hang(tmp_path: Path) -> None:
    # (One empty pass is allowed: a distributed loader resumed at an epoch's very end may have
    # too little left to split; tests/e2e/test_corpus.py covers that. Two in a row are an error.)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _NoBatches()
    run = unbroken.Run(tmp_path, model=model, optimizer=opt, loader=loader, max_steps=3)
    with pytest.raises(ConfigError, match="no batch for a whole epoch"):
        for _ in run.loop(loader):
            run.step()
    run.close()
