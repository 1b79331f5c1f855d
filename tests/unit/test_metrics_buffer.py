"""The metrics log holds step records in memory and writes them together: before anything
records its length (a save, a snapshot), with every event, at close and at exit, and at least
every ``FLUSH_SECONDS`` -- never one ``write`` a step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import unbroken
from unbroken import read_metrics
from unbroken.train import _metrics
from unbroken.train._metrics import MetricsLog


def _run(run_dir: Path, **kw: object) -> unbroken.Run:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return unbroken.Run(run_dir, model=model, optimizer=opt, progress=False, **kw)


@pytest.fixture
def held(monkeypatch):
    """No flush on the clock: neither the first seconds' quick ones nor the every-second one."""
    monkeypatch.setattr(_metrics, "FLUSH_SECONDS", 3600.0)
    monkeypatch.setattr(_metrics, "EARLY", 3600.0)


def test_steps_are_not_written_one_by_one_but_all_before_a_save(tmp_path, held):
    run = _run(tmp_path, save_final=False)
    log = tmp_path / "metrics.jsonl"
    run.step(loss=torch.tensor(0.5))
    size = log.stat().st_size
    for i in range(20):
        run.step(loss=torch.tensor(float(i)))
    assert log.stat().st_size == size  # held in memory: no write a step
    run.save()
    steps = read_metrics(tmp_path)
    assert [r["step"] for r in steps] == list(range(1, 22))
    assert [r["loss"] for r in steps[1:]] == [float(i) for i in range(20)]
    reader = unbroken.CheckpointStore(str(tmp_path)).latest()
    assert reader is not None
    assert reader.global_trees()["counters"]["metrics_offset"] == log.stat().st_size
    run.step(loss=1.0)
    run.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 23))


def test_the_first_steps_show_at_once(tmp_path):
    run = _run(tmp_path, save_final=False)
    run.step(loss=1.0)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
    run.close()


def test_a_flush_comes_at_least_every_flush_seconds(tmp_path, monkeypatch):
    monkeypatch.setattr(_metrics, "FLUSH_SECONDS", 0.0)
    run = _run(tmp_path, save_final=False)
    for i in range(3):
        run.step(loss=float(i))
        assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, i + 2))
    run.close()


def test_an_event_writes_the_steps_before_it_in_order(tmp_path, held):
    log = MetricsLog(str(tmp_path), None)
    log.step({"step": 1, "loss": torch.tensor(2.0)})
    log.event("stop", step=1, reason="test")
    log.step({"step": 2})
    records = read_metrics(tmp_path, events=True)
    assert [r.get("step") for r in records] == [1, 1]
    assert records[0]["loss"] == 2.0 and records[1]["event"] == "stop"
    assert log.length() == (tmp_path / "metrics.jsonl").stat().st_size
    assert read_metrics(tmp_path)[-1] == {"step": 2}
    log.close()


def test_scalars_are_read_when_handed_over_not_at_the_flush(tmp_path):
    """The user's tensor changed in place after run.step(): the log keeps the value of that
    step (a CPU tensor is read at once; on a device it would be copied)."""
    run = _run(tmp_path, save_final=False)
    lr = torch.tensor([0.25])
    loss = torch.tensor(1.0)
    run.step(loss=loss, lr=lr)
    lr.mul_(2)
    loss.add_(1)
    run.close()
    (rec,) = read_metrics(tmp_path)
    assert rec["lr"] == 0.25 and rec["loss"] == 1.0


def test_a_forked_child_does_not_write_the_parents_lines(tmp_path, held):
    log = MetricsLog(str(tmp_path), None)
    log.flush()  # past the first step's own flush
    log.step({"step": 1})
    pid = os.fork()
    if pid == 0:  # a loader worker, say: it exits without writing the parent's buffer
        log.flush()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert (tmp_path / "metrics.jsonl").read_bytes() == b""
    log.close()
    assert read_metrics(tmp_path) == [{"step": 1}]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3])
def test_values_are_written_as_before(tmp_path, value):
    log = MetricsLog(str(tmp_path), None)
    log.step({"step": 1, "x": torch.tensor(value)})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert (
        text == '{"step": 1, "x": ' + {3: "3", float("inf"): "Infinity"}.get(value, "NaN") + "}\n"
    )


def test_under_unbroken_verify_each_step_is_written_as_it_ends(tmp_path, held, monkeypatch):
    """verify fires its step targets when the log shows the step: no batching there."""
    monkeypatch.setenv("UNBROKEN_RUN_DIR", str(tmp_path))
    run = _run(tmp_path, save_final=False)
    for i in range(3):
        run.step(loss=float(i))
        assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, i + 2))
    run.close()
