"""The command line as a new user meets it: ``ls``/``inspect``/``pin`` in one process, AGE from
the commit time, errors that list what exists, a closed pipe that is not an error, RNG states
summarised, the progress bar's counts, one line per fact after a kill."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import unbroken
from tests.golden import ROOT
from unbroken.train._triggers import Clock, next_save_text

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _cli(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unbroken", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of steps 2 and 4 of a model, its optimizer and the random streams."""
    d = tmp_path_factory.mktemp("cli") / "run"
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    with unbroken.Run(d, model=model, optimizer=opt, save_every=2, progress=False) as run:
        for _ in range(4):
            model(torch.randn(1, 3)).sum().backward()
            opt.step()
            run.step()
    return d


_COMMANDS = """
import sys
from unbroken.cli import main
codes = [main(args) for args in {commands!r}]
print("CODES", codes)
"""


def test_ls_inspect_and_pin_in_one_process(run_dir: Path) -> None:
    commands = [
        ["ls", str(run_dir)],
        ["ls", str(run_dir), "--json"],
        ["inspect", str(run_dir)],
        ["inspect", str(run_dir / "checkpoints" / "step-000000002"), "--json"],
        ["pin", str(run_dir), "2"],
        ["unpin", str(run_dir), "2"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _COMMANDS.format(commands=commands)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "CODES [0, 0, 0, 0, 0, 0]" in proc.stdout, proc.stdout + proc.stderr
    assert "valid, latest" in proc.stdout
    assert "exp_avg_sq" in proc.stdout and "[2, 3]" in proc.stdout  # inspect's tensor table


def test_ls_age_is_the_commit_time_not_the_mtime(run_dir: Path) -> None:
    ckpt = run_dir / "checkpoints" / "step-000000004"
    saved_at = json.loads((ckpt / "manifest.json").read_text())["saved_at_unix"]
    day_ago = time.time() - 86400
    os.utime(ckpt, (day_ago, day_ago))  # what pin, a copy or a backup tool may do to the mtime
    rows = json.loads(_cli("ls", str(run_dir), "--json").stdout)
    row = next(r for r in rows if r["step"] == 4)
    assert row["saved_at_unix"] == saved_at
    assert abs(row["age_seconds"] - (time.time() - saved_at)) < 60, row
    table = _cli("ls", str(run_dir)).stdout
    assert "1d" not in table, table


def test_pin_of_a_missing_step_lists_the_steps_there(run_dir: Path) -> None:
    proc = _cli("pin", str(run_dir), "75")
    assert proc.returncode == 3
    assert "no checkpoint for step 75" in proc.stderr
    assert "the steps it holds: 2, 4" in proc.stderr, proc.stderr


def test_export_ema_without_an_ema_names_no_other_component(run_dir: Path, tmp_path) -> None:
    proc = _cli(
        "export", str(run_dir), "--ema", "--to", "safetensors", "--out", "x.st", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "holds no EMA (unbroken.EMA)" in proc.stderr, proc.stderr
    assert "drop --ema (modules: model)" in proc.stderr
    for other in ("optimizer", "counters", "rng"):
        assert other not in proc.stderr, proc.stderr


def test_a_closed_pipe_is_not_an_error(run_dir: Path) -> None:
    """``unbroken diff A B | head``: the reader went away before the report was written."""
    ckpt = run_dir / "checkpoints" / "step-000000002"
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "diff", str(ckpt), str(run_dir)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert err == "", err
    assert proc.returncode == 1  # the checkpoints differ; nothing about the pipe


def test_diff_summarises_random_generator_states(run_dir: Path) -> None:
    ckpt = run_dir / "checkpoints" / "step-000000002"
    out = _cli("diff", str(ckpt), str(run_dir)).stdout
    (line,) = [line for line in out.splitlines() if line.startswith("rng@rank0")]
    assert "torch_cpu: 5056 bytes (xxh3 " in line, line
    assert "\\x" not in out, out


@pytest.mark.parametrize(
    ("every", "max_steps", "step", "text"),
    [
        (10, 40, 39, "next save in 1 step"),
        (10, 40, 38, "next save in 2 steps"),
        (10, 40, 40, ""),  # complete: the final save, none after it
        (10, 38, 35, "next save in 3 steps"),  # the final save comes first
        (10, None, 30, "next save in 10 steps"),
    ],
)
def test_the_progress_bar_counts_the_next_save_right(
    every: int, max_steps: int | None, step: int, text: str
) -> None:
    cfg = unbroken.RunConfig(save_every=every, max_steps=max_steps)
    now = time.time()
    clock = Clock(now=now, last_save=now, step_seconds=None, save_seconds=None, deadline=None)
    assert next_save_text(cfg, step, clock) == text


_KILLED = """
import os, signal, sys, torch, unbroken
run_dir = sys.argv[1]
unbroken.seed_everything(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
run = unbroken.Run(
    run_dir, model=model, optimizer=opt, save_every=5, snapshot_every=1, max_steps=8,
    progress=False,
)
for _ in run.loop(range(100)):
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    run.step()
    if run.counters.step == 7 and not os.path.exists(os.path.join(run_dir, "killed")):
        open(os.path.join(run_dir, "killed"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_after_a_kill_the_snapshot_kept_is_said_once(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_KILLED)
    run_dir = tmp_path / "run"
    proc = _cli("run", "--backoff", "0", "--", sys.executable, str(script), str(run_dir))
    assert proc.returncode == 0, proc.stderr
    live, _, report = proc.stderr.partition("unbroken run: report for")
    # Killed right after run.step() of step 7: the snapshot of step 7 is committed by the
    # snapshot's thread while step 8 would compute, so the one kept is of step 7 or, when the
    # kill came first, of step 6 -- at most one step lost either way.
    kept = re.findall(r"kept the in-memory snapshot of step (\d+)", live)
    assert len(kept) == 1 and kept[0] in ("6", "7"), live
    said = [line for line in live.splitlines() if f"in-memory snapshot of step {kept[0]}" in line]
    assert len(said) == 1, live
    assert "attempt 1:" in said[0]
    assert "resumed" in live and f"from step {kept[0]}" in live


def test_every_help_is_plain_text() -> None:
    """The commands' descriptions are the modules' reST docstrings: --help shows no markup."""
    from unbroken.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():  # type: ignore[union-attr]
        text = p.format_help()
        for markup in ("``", ":func:", ":class:", ":meth:"):
            assert markup not in text, f"unbroken {name} --help shows {markup!r}"


def test_the_demo_says_how_to_get_the_plot(tmp_path: Path, monkeypatch) -> None:
    from unbroken.cli import _demo

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert _demo.plot(tmp_path, tmp_path, tmp_path / "demo.png") is None
    assert "pip install matplotlib" in _demo.PLOT_HINT and "[plot]" in _demo.PLOT_HINT
