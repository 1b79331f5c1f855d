"""``unbroken demo``: train the char-level LM twice -- once straight through, once while being
killed (SIGKILL and SIGTERM at random moments) and relaunched -- and compare the two, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._exit import EXIT_FAILURE, EXIT_OK, EXIT_RESUMABLE
from .._logfile import last_logged_step, read_metrics


def default_script() -> Path:
    """``char_lm.py`` of the installed package (the wheel maps ``examples/`` to
    ``unbroken._examples``, with its corpus), else of the source checkout (an editable install
    does not map it)."""
    import importlib.util

    spec = importlib.util.find_spec("unbroken._examples")
    for where in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(where) / "char_lm.py"
        if candidate.is_file():
            return candidate
    return Path(__file__).resolve().parents[2] / "examples" / "char_lm.py"


@dataclass
class Attempt:
    signal: str
    target_step: int
    exit_code: int
    seconds: float
    resumed_from: int | None


@dataclass
class Outcome:
    seconds: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train the example twice (straight, and killed + relaunched) and compare",
        description=__doc__,
    )
    p.add_argument("--out", default="demo-out", help="output directory (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default: %(default)s)")
    p.add_argument("--save-every", type=int, default=25, help="(default: %(default)s)")
    p.add_argument("--kills", type=int, default=4, help="interruptions (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="picks the kill moments")
    p.add_argument("--script", default=None, help="the training script (default: char_lm.py)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG of the loss curves")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    script = Path(args.script) if args.script else default_script()
    if not script.is_file():
        print(
            f"unbroken demo: {script} not found; reinstall unbroken (the wheel ships it) "
            "or pass --script",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    print(f"script: {script}", flush=True)
    out = Path(args.out)
    ref_dir, int_dir = out / "uninterrupted", out / "interrupted"
    for d in (ref_dir, int_dir):
        shutil.rmtree(d, ignore_errors=True)
    common = ["--steps", str(args.steps), "--save-every", str(args.save_every)]
    print(f"[1/3] uninterrupted run of {args.steps} steps -> {ref_dir}", flush=True)
    ref = _train(script, common, ref_dir, [])
    rng = random.Random(args.seed)
    kills = max(0, min(args.kills, args.steps - 2))
    targets = sorted(rng.sample(range(1, args.steps - 1), kills))
    plan = [(t, "KILL" if i % 2 == 0 else "TERM") for i, t in enumerate(targets)]
    print(
        f"[2/3] interrupted run: {', '.join(f'SIG{s} at step ~{t}' for t, s in plan)}", flush=True
    )
    inter = _train(script, common, int_dir, plan)
    print("[3/3] comparing", flush=True)
    report = compare(ref_dir, int_dir)
    _print_table(report, ref, inter)
    if not args.no_plot:
        png = plot(ref_dir, int_dir, out / "demo.png")
        print(f"loss curves: {png}" if png else "loss curves: matplotlib not installed, skipped")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return EXIT_OK if report["identical"] else EXIT_FAILURE


def _train(script: Path, common: list[str], run_dir: Path, plan: list[tuple[int, str]]) -> Outcome:
    outcome = Outcome()
    t0 = time.perf_counter()
    cmd = [sys.executable, str(script), *common, "--run-dir", str(run_dir)]
    for target, sig in [*plan, (0, "")]:
        a0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if sig:
            _wait_for_step(run_dir, target, proc)
            if proc.poll() is None:
                proc.send_signal(getattr(signal, "SIG" + sig))
        out, err = proc.communicate()
        code = proc.returncode
        resumed = next(
            (int(line.split()[-1]) for line in out.splitlines() if line.startswith("resumed from")),
            None,
        )
        outcome.attempts.append(
            Attempt(sig or "-", target, code, time.perf_counter() - a0, resumed)
        )
        expected = {"KILL": -signal.SIGKILL, "TERM": EXIT_RESUMABLE, "": 0}[sig]
        if code != expected and not (sig and code == 0):
            raise SystemExit(f"unbroken demo: training exited {code} unexpectedly:\n{err[-3000:]}")
        label = "completed" if code == 0 else f"exit {code}"
        origin = "fresh start" if resumed is None else f"resumed at step {resumed}"
        at = last_logged_step(run_dir)
        print(f"      launch {len(outcome.attempts)}: {origin}, {label} at step {at}", flush=True)
    outcome.seconds = time.perf_counter() - t0
    return outcome


def _wait_for_step(run_dir: Path, target: int, proc: subprocess.Popen[str]) -> None:
    while proc.poll() is None and last_logged_step(run_dir) < target:
        time.sleep(0.05)


def compare(ref_dir: Path, other_dir: Path) -> dict[str, Any]:
    """Weights (model and EMA) and per-step losses of two char_lm runs."""
    import torch
    from safetensors.torch import load_file

    a = load_file(str(ref_dir / "final.safetensors"))
    b = load_file(str(other_dir / "final.safetensors"))
    same_keys = a.keys() == b.keys()
    max_diff = 0.0
    equal = 0
    for k in a.keys() & b.keys():
        if torch.equal(a[k], b[k]):
            equal += 1
        elif a[k].shape == b[k].shape:
            max_diff = max(max_diff, (a[k].double() - b[k].double()).abs().max().item())
        else:
            max_diff = float("inf")
    ta, tb = _trace(ref_dir), _trace(other_dir)
    losses_equal = [r["loss"] for r in ta] == [r["loss"] for r in tb]
    samples_equal = [r["samples"] for r in ta] == [r["samples"] for r in tb]
    return {
        "tensors": len(a),
        "tensors_equal": equal,
        "max_abs_diff": max_diff,
        "steps": [len(ta), len(tb)],
        "losses_identical": losses_equal,
        "samples_identical": samples_equal,
        "final_loss": [ta[-1]["loss"] if ta else None, tb[-1]["loss"] if tb else None],
        "identical": same_keys and equal == len(a) and losses_equal and samples_equal,
    }


def _trace(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "trace.jsonl") as f:
        return [json.loads(line) for line in f]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir, events=True) if "event" in r]


def _print_table(r: dict[str, Any], ref: Outcome, inter: Outcome) -> None:
    kinds = [a.signal for a in inter.attempts if a.signal != "-"]
    rows = [
        ("optimizer steps", r["steps"][0], r["steps"][1]),
        (
            "launches",
            len(ref.attempts),
            f"{len(inter.attempts)} ({kinds.count('KILL')} SIGKILL, {kinds.count('TERM')} SIGTERM)",
        ),
        (
            "resumed from step",
            "-",
            ", ".join(
                "fresh" if a.resumed_from is None else str(a.resumed_from)
                for a in inter.attempts[1:]
            )
            or "-",
        ),
        ("final loss", f"{r['final_loss'][0]:.6f}", f"{r['final_loss'][1]:.6f}"),
        ("max |delta param|", "-", f"{r['max_abs_diff']:g}"),
        ("tensors bitwise equal", "-", f"{r['tensors_equal']}/{r['tensors']}"),
        ("losses identical", "-", "yes" if r["losses_identical"] else "NO"),
        ("samples identical", "-", "yes" if r["samples_identical"] else "NO"),
        ("wall time", f"{ref.seconds:.0f} s", f"{inter.seconds:.0f} s"),
    ]
    print()
    print(f"{'':24}{'uninterrupted':>16}   {'interrupted + resumed'}")
    for name, x, y in rows:
        print(f"{name:24}{x!s:>16}   {y}")
    print()
    print("RESULT: bit-for-bit identical" if r["identical"] else "RESULT: runs DIFFER")


def plot(ref_dir: Path, other_dir: Path, png: Path) -> Path | None:
    """Both loss curves, resume points marked; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ta, tb = _trace(ref_dir), _trace(other_dir)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(
        [r["step"] for r in ta], [r["loss"] for r in ta], lw=3, alpha=0.4, label="uninterrupted"
    )
    ax.plot(
        [r["step"] for r in tb],
        [r["loss"] for r in tb],
        lw=1,
        color="k",
        ls="--",
        label="interrupted + resumed",
    )
    for i, e in enumerate(x for x in _events(other_dir) if x.get("event") == "resume"):
        ax.axvline(e["step"], color="tab:red", lw=0.8, label="resume point" if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("unbroken: the interrupted run retraces the uninterrupted one exactly")
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
