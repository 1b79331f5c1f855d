"""unbroken reports its operational events through logging ("unbroken" and its children), on
rank 0, never through print or warnings: resume, save, fallback past an unusable checkpoint,
stop. With logging unconfigured the WARNING ones (the stop above all) still reach stderr, and so
does the resume (announced: one line on rank 0)."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

import unbroken
from tests._logs import log_records
from tests.dist_launch import launch
from tests.golden import ROOT

SCRIPT = ROOT / "tests" / "scripts" / "log_ranks.py"


def _lines(text: str, prefix: str = "LOG ") -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_two_ranks_log_on_rank_0_only(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    # Launch 1: fresh, saves steps 2 and 4 (final); logging configured at INFO on every rank.
    codes, errs = launch(SCRIPT, ["--run-dir", run_dir, "--steps", "4", "--configure"], 2)
    assert codes == [0, 0], errs
    rank0 = _lines(errs[0])
    assert any("LOG INFO r0 unbroken: saved step 2 to" in line for line in rank0), errs[0]
    assert any("saved step 4" in line for line in rank0), errs[0]
    assert _lines(errs[1]) == [], errs[1]  # rank 1 repeats none of it
    # Launch 2: resumes the complete run, continues it and is stopped by SIGTERM at step 6.
    args = ["--run-dir", run_dir, "--steps", "8", "--stop-at", "6", "--configure"]
    codes, errs = launch(SCRIPT, args, 2)
    assert codes == [75, 75], errs
    rank0 = "\n".join(_lines(errs[0]))
    assert "LOG INFO r0 unbroken: resumed" in rank0 and "from step 4" in rank0, errs[0]
    assert "LOG WARNING r0 unbroken: " in rank0 and "continuing it to max_steps=8" in rank0
    assert "LOG WARNING r0 unbroken: stopped at step 6 (signal SIGTERM)" in rank0, errs[0]
    assert _lines(errs[1]) == [], errs[1]
    # Launch 3: logging left unconfigured. The stop still reaches rank 0's stderr (through
    # logging.lastResort), once, and the resume is announced there, once; other INFO records
    # (saves) are not shown; rank 1 says nothing.
    codes, errs = launch(SCRIPT, ["--run-dir", run_dir, "--steps", "10", "--stop-at", "8"], 2)
    assert codes == [75, 75], errs
    assert errs[0].count("unbroken: stopped at step 8 (signal SIGTERM)") == 1, errs[0]
    assert "relaunch the same command to continue" in errs[0]
    resumed = [line for line in errs[0].splitlines() if "resumed" in line]
    assert resumed == [f"unbroken: resumed {run_dir} from step 6 (checkpoints/step-000000006)"]
    assert "saved step" not in errs[0], errs[0]
    assert "unbroken" not in errs[1], errs[1]


_UNDER_W_ERROR = """
import os, signal, sys, torch, unbroken
run_dir, stop_at = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
run = unbroken.Run(run_dir, model=model, optimizer=opt, save_every=2, max_steps=6,
                   keep_last=None, progress=False)
print("resumed", run.resumed_from, flush=True)
while not run.done:
    loss = model(torch.ones(2, 3)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if run.counters.step + 1 == stop_at:
        os.kill(os.getpid(), signal.SIGTERM)
    run.step(loss=loss)
run.finish()
"""


def test_operational_events_are_not_exceptions_under_W_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"

    def launch_once(stop_at: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-W", "error", "-c", _UNDER_W_ERROR, str(run_dir), str(stop_at)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )

    first = launch_once(stop_at=5)  # saves 2, 4; SIGTERM in step 5: saves 5, exits 75
    assert first.returncode == 75, first.stderr
    assert "unbroken: stopped at step 5 (signal SIGTERM)" in first.stderr, first.stderr
    # The newest checkpoint is damaged: the next launch logs the fallback and goes on.
    (run_dir / "checkpoints" / "step-000000005" / "state.json").write_text("{")
    second = launch_once(stop_at=0)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0] == "resumed 4", second.stdout
    assert "unbroken: skipping unusable checkpoint" in second.stderr, second.stderr
    assert "moved aside" in second.stderr and "Traceback" not in second.stderr, second.stderr


def test_records_name_their_step_path_and_rank(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    with log_records(logging.INFO) as records:
        run = unbroken.Run(tmp_path, model=model, save_every=1, progress=False)
        run.step()
        run.close()
        again = unbroken.Run(tmp_path, model=model, progress=False)
        again.close()
    saved = [r for r in records if "saved step 1" in r.getMessage()]
    resumed = [r for r in records if "resumed" in r.getMessage()]
    assert len(saved) == 1 and len(resumed) == 1, [r.getMessage() for r in records]
    ckpt = os.path.join(str(tmp_path), "checkpoints", "step-000000001")
    for r in (*saved, *resumed):
        assert (r.name, r.levelno, r.step, r.path, r.rank) == (
            "unbroken.run",
            logging.INFO,
            1,
            ckpt,
            0,
        )


def test_the_library_never_prints_outside_the_cli() -> None:
    pkg = ROOT / "unbroken"
    found = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        if rel.parts[0] in ("cli", "_examples", "supervise"):
            # The command line prints: that is its output; so does the supervisor of `unbroken
            # run`, whose lines on stderr are that command's report.
            continue
        if rel.as_posix() == "verify/_forkserver.py":
            continue  # prints a forked script's SystemExit message, as Python itself would
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                found.append(f"{rel}:{node.lineno}")
    assert found == [], (
        f"print() in the library (log through unbroken.process._log instead): {found}"
    )
