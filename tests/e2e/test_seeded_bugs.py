"""The seeded-bug library (issue 17): every way a script can silently lose exactness is caught --
at start-up where Run can see it, else by ``verify_resume``, which names the component that
diverges and gives the right hint first. The same script without a bug passes.

tests/scripts/bugs/train.py holds the bugs (``--bug NAME``): tiny, 6 steps, one interruption
each; the verifications run two at a time in the module fixture.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.golden import ROOT
from unbroken.verify import Comparison, Difference, ScriptFailedError, verify_resume
from unbroken.verify import _report as R

SCRIPT = ROOT / "tests" / "scripts" / "bugs" / "train.py"


def _first(template: str) -> str:
    """The fixed opening of a hint (before its first placeholder)."""
    return template.split("{", 1)[0]


# bug -> (components of which one must be the first to differ, the hint that must come first)
CAUGHT_BY_VERIFY = {
    "scheduler": ({"optimizer"}, R.LR),
    "scaler": ({"optimizer", "model", "head", "scale"}, _first(R.SKIPPED)),
    "ema": ({"metrics"}, _first(R.EMA_METRIC)),
    "generator": ({"optimizer", "model", "head", "scale"}, R.GENERATOR),
    "numpy": ({"optimizer", "model", "head", "scale"}, R.GENERATOR),
    "pyrandom": ({"optimizer", "model", "head", "scale"}, R.GENERATOR),
    # A plain DataLoader draws its iterator's seed from the torch global stream: rng differs.
    "loader-epochs": ({"rng", "optimizer", "model", "head", "scale"}, R.LOADER),
    "draw": ({"rng"}, _first(R.RNG_AFTER_RUN)),
    "callback": ({"counters"}, _first(R.CALLBACK)),
    "buffer": ({"optimizer", "model", "head", "scale"}, _first(R.HIDDEN_STATE)),
    # Issue 49: draws made ahead of the save (the Trainer's masking collator on a prefetched
    # batch), and a first step after a resume that sums gradients in another order.
    "collate": ({"rng", "optimizer", "model", "head", "scale"}, _first(R.RNG_AHEAD)),
    "reduce": ({"optimizer", "model", "head", "scale"}, _first(R.REDUCTION)),
}
# Differences that first appear at the first step after a resume: `parted` must say so.
AT_THE_FIRST_STEP_AFTER_A_RESUME = ("collate", "reduce", "generator", "pyrandom")
# bug -> (the error's class, what its message must name)
CAUGHT_AT_START = {
    "loader-loop": ("ConfigError", "unbroken.MapLoader"),
    "parameter": ("StateError", "no tracked module owns"),
    "module": ("StateError", "no tracked module owns"),
}


def _verify(work: Path, bug: str) -> Any:
    try:
        return verify_resume(
            [sys.executable, str(SCRIPT), "--bug", bug],
            interrupts=1,
            work_dir=work / bug,
            timeout=120,
        )
    except ScriptFailedError as e:
        return e


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("bugs")
    bugs = ["none", "volatile", *CAUGHT_BY_VERIFY, *CAUGHT_AT_START]
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(max_workers=2) as pool:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.setenv("PYTHONPATH", str(ROOT))
        futures = {bug: pool.submit(_verify, work, bug) for bug in bugs}
        return {bug: f.result() for bug, f in futures.items()}


@pytest.mark.slow  # the fixture: 14 verifications of up to 3 launches, 3 refused at start
def test_the_correct_script_passes(reports: dict[str, Any]) -> None:
    report = reports["none"]
    assert not isinstance(report, Exception), report
    assert report.passed, report.summary()
    assert report.resumed_from and report.resumed_from[0] > 0


@pytest.mark.slow
def test_volatile_fields_pass_and_are_listed_as_not_compared(reports: dict[str, Any]) -> None:
    report = reports["volatile"]
    assert not isinstance(report, Exception), report
    assert report.passed, report.summary()
    listed = {n.path: n.source for n in report.not_compared}
    assert listed.get("trainer_state.log_history.*.train_runtime") == "transformers", listed
    assert "trainer_state.log_history.*.train_samples_per_second" in listed, listed
    assert "not compared" in report.summary() and "train_runtime" in report.summary()
    # The loss in the same entries is compared (and agrees).
    assert "trainer_state.log_history.*.loss" not in listed


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(CAUGHT_BY_VERIFY))
def test_verify_names_the_component_and_the_hint(reports: dict[str, Any], bug: str) -> None:
    report = reports[bug]
    assert not isinstance(report, Exception), f"{bug}: {report}"
    components, hint = CAUGHT_BY_VERIFY[bug]
    assert not report.passed, f"{bug} passed"
    summary = report.summary()
    first = report.first_difference
    assert first is not None and first.component.split("@")[0] in components, summary
    assert report.hints and report.hints[0].startswith(hint), f"{bug}:\n{summary}"


@pytest.mark.slow
@pytest.mark.parametrize("bug", AT_THE_FIRST_STEP_AFTER_A_RESUME)
def test_a_difference_at_the_first_step_after_a_resume_is_named_so(
    reports: dict[str, Any], bug: str
) -> None:
    report = reports[bug]
    assert not isinstance(report, Exception), f"{bug}: {report}"
    resume = min(r for r in report.resumed_from if r > 0)
    summary = report.summary()
    assert report.parted is not None, summary
    assert f"the first step after the resume from step {resume}" in report.parted, summary
    assert "not a resume problem" not in " ".join(report.hints), summary


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(CAUGHT_AT_START))
def test_start_up_refuses_what_it_can_see(reports: dict[str, Any], bug: str) -> None:
    error = reports[bug]
    assert isinstance(error, ScriptFailedError), error
    kind, named = CAUGHT_AT_START[bug]
    assert kind in error.log and named in error.log, error.log[-2000:]


# ---- the ranking itself, without processes ----------------------------------------------------


def _cmp(*diffs: Difference, **evidence: Any) -> Comparison:
    kinds = {"model": "module", "optimizer": "optimizer", "loader": "loader", "rng": "rng"}
    return Comparison([4, 8], 8, list(diffs), {**kinds, "counters": "counters"}, **evidence)


MOMENT = Difference(8, "optimizer", "state.0.weight.exp_avg", "tensor", "a", "b", 0.1)
WEIGHT = Difference(8, "model", "0.weight", "tensor", "a", "b", 0.1)


def test_an_untracked_parameter_outranks_an_untracked_generator() -> None:
    # Found from outside: the optimizer moment of a parameter no module owns diverged, and the
    # first hint was "untracked generator".
    hints = R.hints_for(_cmp(WEIGHT, MOMENT, untracked_params={"optimizer": ["#4"]}), [4])
    assert hints[0].startswith(_first(R.UNTRACKED_PARAM)) and "#4" in hints[0]
    assert R.GENERATOR in hints[1:]
    assert R.hints_for(_cmp(WEIGHT, MOMENT), [4])[0] == R.GENERATOR  # no such evidence


def test_audit_events_and_saved_overrides_come_first() -> None:
    audit = [{"event": "audit", "check": "rng_after_run", "streams": ["the torch global RNG"]}]
    hints = R.hints_for(_cmp(WEIGHT, audit=audit), [4])
    assert hints[0].startswith(_first(R.RNG_AFTER_RUN)) and "the torch global RNG" in hints[0]
    overrides = Difference(8, "counters", "overrides.clip", "state", "0.5", "1.0")
    lr = Difference(8, "optimizer", "param_groups.0.lr", "state", "0.1", "0.2")
    assert R.hints_for(_cmp(overrides, lr, WEIGHT), [4])[0].startswith(_first(R.CALLBACK))
    skipped = Difference(8, "optimizer", "state.0.weight.step", "tensor", "3", "4", 1.0)
    assert R.hints_for(_cmp(WEIGHT, skipped), [4])[0].startswith(_first(R.SKIPPED))
    ema = Difference(6, "metrics", "ema_loss", "metric", "0.1", "0.2")
    assert R.hints_for(_cmp(ema), [4])[:2] == [
        R.EMA_METRIC.format(key="ema_loss"),
        R.METRICS_ONLY,
    ]
