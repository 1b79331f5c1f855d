"""``unbroken verify`` / ``verify_resume``: exact scripts pass, each kind of resume bug is caught
and named, the comparison is bitwise, bad input is refused.

The end-to-end verifications (each runs a script 3-5 times) are started once, two at a time, by
the module fixture ``verified``; the tests then look at their reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import faults
from tests.golden import ROOT
from unbroken import ConfigError, RunConfig
from unbroken.cli import main
from unbroken.state import Registry
from unbroken.store import CheckpointStore
from unbroken.verify import (
    Comparison,
    Difference,
    ScriptFailedError,
    Target,
    VerifyError,
    VerifyReport,
    compare_runs,
    plan_interrupts,
    verify_resume,
)
from unbroken.verify._plan import next_target
from unbroken.verify._report import (
    BATCH_MADE,
    GENERATOR,
    LOADER,
    LR,
    METRICS_ONLY,
    NONDET,
    REDUCTION,
    RNG_AHEAD,
    SAMPLES,
    UNSEEDED_GLOBAL,
    hints_for,
    parted,
)

TOY = ROOT / "tests" / "scripts" / "toy_train.py"
BROKEN = ROOT / "tests" / "scripts" / "broken_train.py"
CHAR_LM = ROOT / "examples" / "char_lm.py"
SEQ2SEQ = ROOT / "examples" / "seq2seq.py"
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
SLOW_SAVES = {**ENV, faults.PLAN_ENV: "slow:0.06"}


def _cli(
    work: Path, interrupts: int, *cmd: str, env: dict[str, str] = ENV
) -> tuple[int, dict[str, Any]]:
    argv = [PY, "-m", "unbroken", "verify", "--json", "--quiet", "--interrupts", str(interrupts)]
    proc = subprocess.run(
        [*argv, "--work", str(work), "--", *cmd],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.stdout, proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


def _lib(work: Path | None, interrupts: int, *cmd: str, **kw: Any) -> VerifyReport:
    return verify_resume([PY, *cmd], interrupts=interrupts, work_dir=work, timeout=300, **kw)


@pytest.fixture(scope="module")
def verified(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every end-to-end verification of this file, run two at a time (longest first)."""
    work = tmp_path_factory.mktemp("verify")
    toy = ("--steps", "16", "--save-every", "4")
    char_lm = ("--steps", "12", "--save-every", "4", "--workers", "0")
    char_lm += ("--context", "32", "--batch-size", "8")
    s2s = ("--steps", "8", "--save-every", "4", "--lines", "24", "--max-tokens", "600")
    ticks: list[tuple[str, int, int | None]] = []
    jobs: dict[str, Callable[[], Any]] = {
        # The toy script (AdamW, LambdaLR, EMA, noisy data, dropout) through the CLI, K=3;
        # its saves slowed (tests/faults.py) so the kill aimed inside one lands there even
        # when the two cores are busy (a toy save takes a millisecond).
        "toy": lambda: _cli(
            work / "toy", 3, PY, str(TOY), "--run-dir", "{run_dir}", *toy, env=SLOW_SAVES
        ),
        # The demo's char-level transformer (AMP + GradScaler, EMA), K=2, default temp dir.
        "char_lm": lambda: _lib(
            None,
            2,
            *(str(CHAR_LM), "--run-dir", "{run_dir}", *char_lm),
            step_progress=lambda *t: ticks.append(t),
        ),
        # The translation example (token-budget batches of a parallel corpus), K=1.
        "seq2seq": lambda: _lib(work / "seq2seq", 1, str(SEQ2SEQ), "--run-dir", "{run_dir}", *s2s),
        # One interruption is enough to expose each bug; no {run_dir}: UNBROKEN_RUN_DIR.
        "generator": lambda: _cli(work / "generator", 1, PY, str(BROKEN), "--bug", "generator"),
        **{
            bug: (lambda bug=bug: _lib(work / bug, 1, str(BROKEN), "--bug", bug))
            for bug in ("scheduler", "loader", "dropout", "shuffle", "none")
        },
    }
    # Two at a time on few cores: one intra-op thread per training process avoids OpenMP
    # oversubscription (both runs of a verification get the same setting).
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(max_workers=2) as pool:
        mp.setenv("OMP_NUM_THREADS", "1")
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()} | {"char_lm_ticks": ticks}


# ---- exact scripts pass ---------------------------------------------------------------------


def test_toy_script_passes_via_cli_json(verified: dict[str, Any]) -> None:
    code, report = verified["toy"]
    assert code == 0, report
    assert report["passed"] is True and report["first_difference"] is None
    assert report["checkpoints_compared"] == [4, 8, 12, 16]
    assert report["metrics_compared"] == 16
    kills = report["interruptions"]
    assert len(kills) == 3 and {k["signal"] for k in kills} == {"SIGKILL", "SIGTERM"}
    # A signal may land after this fast script's last step (exit 0, noted): no relaunch then.
    effective = [k for k in kills if k["exit_code"] != 0]
    assert len(effective) >= 2 and report["launches"] == 1 + len(effective)
    assert len(report["notes"]) == len(kills) - len(effective)
    # The fault point: one SIGKILL landed while a save was being written.
    saves = [k for k in kills if k["moment"].startswith("save of step")]
    assert len(saves) == 1 and saves[0]["during_save"] and saves[0]["exit_code"] == -9
    assert all(r > 0 for r in report["resumed_from"])


def test_char_lm_passes(verified: dict[str, Any]) -> None:
    report: VerifyReport = verified["char_lm"]
    assert report.passed, report.summary()
    assert report.checkpoints_compared == [4, 8, 12] and report.metrics_compared == 12
    assert len(report.interruptions) == 2 and report.launches == 3
    assert report.work_dir is None  # the temp dir is removed after a pass
    assert "PASS" in report.summary()


def test_step_progress_reports_each_launch(verified: dict[str, Any]) -> None:
    ticks = verified["char_lm_ticks"]
    labels = {label for label, _, _ in ticks}
    # Side by side (2 cores or more), the ticks follow the interrupted run alone.
    beside = verified["char_lm"].side_by_side
    assert ("reference" in labels) != beside and "interrupted, launch 1" in labels, labels
    assert all(0 <= step <= 12 for _, step, _ in ticks)
    assert {total for label, _, total in ticks if label != "reference"} == {12}


def test_seq2seq_passes(verified: dict[str, Any]) -> None:
    report: VerifyReport = verified["seq2seq"]
    assert report.passed, report.summary()
    assert report.checkpoints_compared == [4, 8] and report.metrics_compared == 8
    assert len(report.interruptions) == 1


def test_the_bug_free_variant_passes(verified: dict[str, Any]) -> None:
    report: VerifyReport = verified["none"]
    assert report.passed, report.summary()
    assert report.resumed_from and report.resumed_from[0] > 0
    assert any("UNBROKEN_RUN_DIR" in n for n in report.notes)


# ---- each bug is caught and named -----------------------------------------------------------


def test_untracked_generator_is_caught_via_cli(verified: dict[str, Any]) -> None:
    code, report = verified["generator"]
    assert code == 1
    assert report["passed"] is False
    first = report["first_difference"]
    assert first["component"] in ("model", "optimizer") and first["kind"] == "tensor"
    assert first["step"] > report["resumed_from"][0]
    assert "generator" in report["hints"][0]
    assert report["first_metric_difference"]["key"] == "loss"
    assert os.path.isdir(os.path.join(report["work_dir"], "interrupted"))  # kept on failure


def test_untracked_scheduler_is_caught(verified: dict[str, Any]) -> None:
    report: VerifyReport = verified["scheduler"]
    assert not report.passed
    assert report.first_difference is not None
    assert report.first_difference.where == "optimizer.param_groups.0.lr"
    assert report.first_metric_difference is not None
    assert report.first_metric_difference.key == "lr"
    assert report.hints[0] == LR
    assert "optimizer.param_groups.0.lr first differs at step" in report.summary()


def test_non_resumable_loader_is_caught(verified: dict[str, Any]) -> None:
    report: VerifyReport = verified["loader"]
    assert not report.passed
    assert report.first_metric_difference is not None
    assert report.first_metric_difference.key == "loss"
    assert {d.component for d in report.differences} >= {"model", "optimizer"}
    assert report.hints[0] == LOADER


def test_untracked_dropout_generator_is_caught(verified: dict[str, Any]) -> None:
    report: VerifyReport = verified["dropout"]
    assert not report.passed
    assert report.first_difference is not None
    assert report.first_difference.component == "model"
    assert "generator" in report.hints[0] and "dropout" in report.hints[0]
    assert not any("not resumable" in h for h in report.hints)  # its loader is tracked


def test_a_dataset_shuffling_with_its_own_unseeded_rng_is_caught(verified: dict[str, Any]) -> None:
    report: VerifyReport = verified["shuffle"]
    assert not report.passed
    assert report.first_difference is not None
    # The runs differ before any resume: named as the script not repeating itself.
    resumes = [r for r in report.resumed_from if r > 0]
    assert not resumes or report.first_difference.step <= min(resumes)
    assert "not a resume problem" in report.hints[0]


# ---- compare_runs on existing run directories -----------------------------------------------


def test_compare_runs_on_kept_dirs(verified: dict[str, Any]) -> None:
    report: VerifyReport = verified["dropout"]
    assert report.work_dir is not None
    ref, other = (os.path.join(report.work_dir, n) for n in ("reference", "interrupted"))
    cmp = compare_runs(ref, other)
    assert cmp.first_difference == report.first_difference
    assert compare_runs(ref, ref).passed
    # Only the weights, their momentum and the losses differ: leaving them out passes ...
    assert compare_runs(ref, other, ignore=("model", "optimizer", "metrics.loss")).passed
    # ... and so does a tolerance wider than the differences.
    assert compare_runs(ref, other, atol=10.0).passed
    with pytest.raises(VerifyError):
        compare_runs(ref, os.path.join(report.work_dir, "no-such-run"))


class Box:
    """A component holding one tensor and one float."""

    def __init__(self, t: torch.Tensor, x: float) -> None:
        self.t, self.x = t, x

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "x": self.x}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t, self.x = sd["t"], sd["x"]


def _run_dir(path: Path, t: torch.Tensor, x: float = 0.5) -> Path:
    reg = Registry()
    reg.add("box", Box(t, x))
    CheckpointStore(str(path)).save(3, reg.collect(), {})
    return path


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        pytest.param([0.0, 1.0], [0.0, 1.0], True, id="same"),
        pytest.param([float("nan")], [float("nan")], True, id="same-nan"),
        pytest.param([0.0], [-0.0], False, id="sign-of-zero"),
        pytest.param([1.0], [1.0 + 2**-20], False, id="last-bits"),
    ],
)
def test_tensors_compare_bitwise(tmp_path: Path, a: list, b: list, equal: bool) -> None:
    ra = _run_dir(tmp_path / "a", torch.tensor(a))
    rb = _run_dir(tmp_path / "b", torch.tensor(b))
    cmp = compare_runs(ra, rb)
    assert cmp.steps == [3]
    assert cmp.passed is equal
    if not equal:
        assert cmp.first_difference == cmp.differences[0]
        assert cmp.differences[0].where == "box.t" and cmp.differences[0].step == 3
        assert compare_runs(ra, rb, atol=1e-5).passed  # within tolerance


def test_json_state_and_dtype_are_compared(tmp_path: Path) -> None:
    ra = _run_dir(tmp_path / "a", torch.zeros(2), x=0.5)
    rb = _run_dir(tmp_path / "b", torch.zeros(2), x=0.25)
    rc = _run_dir(tmp_path / "c", torch.zeros(2, dtype=torch.float64), x=0.5)
    d = compare_runs(ra, rb).first_difference
    assert d is not None and (d.where, d.kind, d.reference, d.other) == (
        "box.x",
        "state",
        "0.5",
        "0.25",
    )
    d = compare_runs(ra, rc).first_difference
    assert d is not None and d.where == "box.t" and "float64" in d.other
    assert compare_runs(ra, rb, ignore=("box.x",)).passed


def test_a_corrupt_checkpoint_is_reported(tmp_path: Path) -> None:
    ra = _run_dir(tmp_path / "a", torch.zeros(4))
    rb = _run_dir(tmp_path / "b", torch.zeros(4))
    (payload,) = (rb / "checkpoints").glob("step-*/tensors-r*.bin")
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
    d = compare_runs(ra, rb).first_difference
    assert d is not None and (d.component, d.kind, d.reference) == (
        "checkpoints",
        "unreadable",
        "readable",
    )
    assert "checksum" in d.other


# ---- unusable input is refused --------------------------------------------------------------


@pytest.mark.parametrize(
    ("cmd", "kwargs"),
    [
        pytest.param("python train.py", {}, id="a-string"),
        pytest.param([], {}, id="empty"),
        pytest.param(["python", 3], {}, id="not-strings"),
        pytest.param(["no-such-executable-xyz"], {}, id="not-found"),
        pytest.param([PY, "t.py"], {"interrupts": -1}, id="negative-interrupts"),
        pytest.param([PY, "t.py"], {"atol": float("nan")}, id="nan-atol"),
    ],
)
def test_bad_input_raises_config_error(cmd: Any, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        verify_resume(cmd, **kwargs)


def test_failing_script_raises_with_its_exit_code(tmp_path: Path) -> None:
    with pytest.raises(ScriptFailedError, match="exited 3") as e:
        verify_resume([PY, "-c", "import sys; print('boom'); sys.exit(3)"], work_dir=tmp_path)
    assert e.value.returncode == 3 and "boom" in e.value.log


def test_script_without_checkpoints_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match="wrote no checkpoint"):
        verify_resume([PY, "-c", "pass"], work_dir=tmp_path)


def test_timeout_kills_the_command(tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match="timed out"):
        verify_resume([PY, "-c", "import time; time.sleep(60)"], work_dir=tmp_path, timeout=1)


def test_foreign_work_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "reference").mkdir()
    with pytest.raises(ConfigError, match="not made by unbroken verify"):
        verify_resume([PY, "-c", "pass"], work_dir=tmp_path)


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify"]) == 2
    assert main(["verify", "--json", "--", "no-such-executable-xyz"]) == 2
    out = capsys.readouterr().out
    assert json.loads(out)["passed"] is False


# ---- the plan, the hints, the keep-all override ---------------------------------------------


def test_plan_is_seeded_sorted_and_kills_one_save() -> None:
    saves = [4, 8, 12, 16]
    plan = plan_interrupts(3, 0, 16, saves)
    assert plan == plan_interrupts(3, 0, 16, saves)
    assert plan != plan_interrupts(3, 1, 16, saves) or plan != plan_interrupts(3, 2, 16, saves)
    assert [t.step for t in plan] == sorted(t.step for t in plan)
    assert len(plan) == 3 and all(t.step > 4 for t in plan)  # after the first checkpoint
    (save,) = [t for t in plan if t.kind == "save"]
    assert save.step in saves and save.signal == "KILL"
    assert [t.signal for t in plan if t.kind == "step"] == ["KILL", "TERM"]
    assert [t.kind for t in plan_interrupts(1, 0, 16, saves)] == ["step"]
    # At most one per step before the last, plus the final save.
    assert [t.moment for t in plan_interrupts(10, 0, 4, [4])] == [
        "step 1",
        "step 2",
        "step 3",
        "save of step 4",
    ]
    assert plan_interrupts(0, 0, 16, saves) == [] and plan_interrupts(3, 0, 1, [1]) == []


def test_a_passed_moment_moves_to_the_next_that_fits() -> None:
    notes: list[str] = []
    pending = [Target("step", 5, "TERM"), Target("save", 8, "KILL")]
    assert next_target(pending, 9, 16, [4, 8, 12, 16], notes) == Target("step", 10, "TERM")
    pending.pop(0)
    assert next_target(pending, 10, 16, [4, 8, 12, 16], notes) == Target("save", 12, "KILL")
    assert next_target([Target("step", 3, "KILL")], 15, 16, [16], notes) is None
    assert notes == ["SIGKILL at step 3 dropped: the run was already past it"]


def _cmp(*diffs: Difference, kinds: dict[str, str] | None = None) -> Comparison:
    return Comparison([4, 8], 8, list(diffs), kinds or {"model": "module", "loader": "loader"})


def test_hints() -> None:
    early = Difference(4, "rng", "python.1.0", "state", "1", "2")
    hints = hints_for(_cmp(early), resumed_from=[8])
    assert hints[:2] == [NONDET.format(resume=8), UNSEEDED_GLOBAL]
    metric = Difference(6, "metrics", "throughput", "metric", "1.0", "2.0")
    assert hints_for(_cmp(metric), resumed_from=[4]) == [METRICS_ONLY]
    lr = Difference(8, "optimizer", "param_groups.0.lr", "state", "0.1", "0.2")
    assert hints_for(_cmp(lr, kinds={"model": "module"}), resumed_from=[4])[:2] == [LOADER, LR]
    assert hints_for(_cmp(), resumed_from=[4]) == []


def test_keep_all_env_overrides_keep_last(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A launch by `unbroken verify` keeps every checkpoint, and says so."""
    from unbroken.process._protocol import ProcessContext
    from unbroken.train._components import retention

    assert retention(RunConfig(keep_last=2), ProcessContext.read(), 0).keep_last == 2
    monkeypatch.setenv("UNBROKEN_KEEP_ALL", "1")
    with caplog.at_level("INFO", logger="unbroken"):
        kept = retention(RunConfig(keep_last=2), ProcessContext.read(), 0)
    assert kept.keep_last is None
    assert "keeping every checkpoint (keep_last=2 set aside)" in caplog.text


# ---- issue 49: volatile fields, the first real difference, hints ranked from it ---------------


class History:
    """A TrainerState-like component: a log history whose entries carry wall-clock fields."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self.entries = entries

    def state_dict(self) -> dict[str, Any]:
        return {"state": {"global_step": 3, "log_history": self.entries}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.entries = sd["state"]["log_history"]


class Timer:
    """Lightning's Timer callback as LightningCallback tracks it: seconds elapsed per stage."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {"train": self.seconds, "validate": 0.0}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seconds = sd["time_elapsed"]["train"]


def _history_dir(path: Path, runtime: float, flos: float = 6e6, timer: float = 1.0) -> Path:
    reg = Registry()
    reg.add("box", Box(torch.zeros(2), 0.5))
    entries = [
        {"loss": 0.5, "step": 2},
        {"eval_loss": 0.4, "eval_runtime": runtime, "eval_samples_per_second": 8 / runtime},
        {"train_runtime": 2 * runtime, "train_steps_per_second": 1 / runtime, "total_flos": flos},
    ]
    reg.add("trainer_state", History(entries))
    reg.add("callback.Timer", Timer(timer))
    CheckpointStore(str(path)).save(3, reg.collect(), {})
    return path


def test_volatile_fields_are_left_out_and_listed_as_not_compared(tmp_path: Path) -> None:
    # Found from outside: a Trainer run's first "difference" was log_history.5.eval_runtime.
    ra = _history_dir(tmp_path / "a", runtime=0.0624)
    rb = _history_dir(tmp_path / "b", runtime=0.0766)
    cmp = compare_runs(ra, rb)
    assert cmp.passed, cmp.differences
    listed = {n.path for n in cmp.not_compared}
    assert {
        "trainer_state.state.log_history.*.eval_runtime",
        "trainer_state.state.log_history.*.eval_samples_per_second",
        "trainer_state.state.log_history.*.train_runtime",
        "trainer_state.state.log_history.*.train_steps_per_second",
    } <= listed, listed
    assert all(n.why for n in cmp.not_compared)
    # total_flos counts operations (6 x tokens x parameters), not time: it is compared.
    rc = _history_dir(tmp_path / "c", runtime=0.0766, flos=7e6)
    d = compare_runs(ra, rc).first_difference
    assert d is not None and d.where == "trainer_state.state.log_history.2.total_flos"
    # Lightning's Timer, and what --ignore leaves out, are listed too.
    rd = _history_dir(tmp_path / "d", runtime=0.0624, timer=2.0)
    cmp = compare_runs(ra, rd, ignore=("box.x",))
    listed = {n.path: n.source for n in cmp.not_compared}
    assert cmp.passed and listed["callback.Timer.time_elapsed"] == "lightning", listed
    assert listed["box.x"] == "--ignore", listed


def test_a_report_names_what_it_did_not_compare(tmp_path: Path) -> None:
    ra = _history_dir(tmp_path / "a", runtime=0.1)
    rb = _history_dir(tmp_path / "b", runtime=0.2)
    cmp = compare_runs(ra, rb)
    report = VerifyReport(True, ["x"], 0, 3, cmp.steps, 0, not_compared=cmp.not_compared)
    text = report.summary()
    assert "not compared" in text and "log_history.*.eval_runtime" in text, text
    listed = report.as_dict()["not_compared"]
    assert {"path", "source", "why"} <= set(listed[0]), listed


def _resume_cmp(*diffs: Difference, world_size: int = 1, **after: dict[str, bool]) -> Comparison:
    kinds = {"model": "module", "optimizer": "optimizer", "loader": "loader", "rng": "rng"}
    kinds |= {"counters": "counters", "trainer_state": "stateful"}
    cmp = Comparison([5, 10, 15], 15, list(diffs), kinds)
    cmp.world_size = world_size
    cmp.after_resume = {int(k.removeprefix("s")): v for k, v in after.items()}
    return cmp


def test_a_difference_at_the_first_step_after_a_resume_is_named_a_resume_problem() -> None:
    # The Trainer case once its wall-clock fields are left out: all agree at step 10 (the
    # resume), the loss differs at 11, the state at the next checkpoint.
    loss = Difference(11, "metrics", "loss", "metric", "2.31", "2.29")
    rng = Difference(15, "rng", "torch", "tensor", "a", "b", 1.0)
    weight = Difference(15, "model", "0.weight", "tensor", "a", "b", 0.1)
    hints = hints_for(_resume_cmp(loss, rng, weight, s11={"loss": False}), resumed_from=[10])
    assert "not a resume problem" not in hints[0] and NONDET.split("(")[0] not in hints[0]
    assert hints[0].startswith(RNG_AHEAD.split("{")[0]), hints
    onset = parted(_resume_cmp(loss, rng, weight, s11={"loss": False}), [10])
    assert onset is not None and "the first step after the resume from step 10" in onset
    assert "metrics.loss" in onset and "resume problem" in onset
    # No random stream differs: the batch is the same (its samples logged and equal).
    cmp = _resume_cmp(loss, weight, s11={"loss": False, "samples": True})
    hints = hints_for(cmp, resumed_from=[10])
    assert hints[0] == GENERATOR and "samples" in (parted(cmp, [10]) or "")
    # The batch's samples differ at that step: the data position.
    samples = Difference(11, "metrics", "samples", "metric", "[1, 2]", "[3, 4]")
    cmp = _resume_cmp(samples, loss, weight, s11={"loss": False, "samples": False})
    assert hints_for(cmp, resumed_from=[10])[0].startswith(SAMPLES.split("{")[0])
    # Only a checksum of the batch differs and the loader agrees: the collate's own generator
    # (issue 49: DataCollatorForLanguageModeling(seed=...)), not the data position.
    batch = Difference(11, "metrics", "batch", "metric", "4467", "4557")
    cmp = _resume_cmp(batch, loss, weight, s11={"loss": False, "batch": False})
    hints = hints_for(cmp, resumed_from=[10])
    assert hints[0].startswith(BATCH_MADE.split("{")[0]) and "seed=" in hints[0], hints
    assert "metrics.batch" in hints[0] and GENERATOR in hints, hints
    # ... unless the loader's position differs too: then it is the data position.
    moved = Difference(15, "loader", "epoch", "value", "1", "2")
    cmp = _resume_cmp(batch, loss, moved, weight, s11={"loss": False, "batch": False})
    hints = hints_for(cmp, resumed_from=[10])
    assert SAMPLES.format(step=11, resume=10) in hints, hints
    assert not any(h.startswith(BATCH_MADE.split("{")[0]) for h in hints), hints
    # Before the first resume took effect it stays non-determinism.
    early = Difference(9, "metrics", "loss", "metric", "2.31", "2.29")
    assert hints_for(_resume_cmp(early, weight), resumed_from=[10])[0] == NONDET.format(resume=10)


def test_an_update_difference_at_the_first_step_after_a_resume_points_at_the_reduction() -> None:
    # DDP at 3 ranks, its first backward in a fresh process reduced in DDP's flat first-iteration
    # layout (found from outside): the loss of step 11 agrees, the update it made does not.
    loss = Difference(12, "metrics", "loss", "metric", "2.31", "2.29")
    weight = Difference(15, "model", "0.weight", "tensor", "a", "b", 0.1)
    moment = Difference(15, "optimizer", "state.0.weight.exp_avg", "tensor", "a", "b", 0.1)
    cmp = _resume_cmp(loss, weight, moment, world_size=3, s11={"loss": True})
    hints = hints_for(cmp, resumed_from=[10])
    assert hints[0].startswith(REDUCTION.split("{")[0]), hints
    assert "bucket" in hints[0] and "docs/distributed.md" in hints[0] and "3 ranks" in hints[0]
    onset = parted(cmp, [10]) or ""
    assert "step 11" in onset and "resume from step 10" in onset
    # Without the loss of step 11 in the log there is no such evidence: the generic list.
    assert hints_for(_resume_cmp(loss, weight, moment, world_size=3), [10])[0] == GENERATOR
