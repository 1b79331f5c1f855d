"""The ``unbroken demo`` command: the example's char-level transformer trained twice and compared.

The help text below is shown by ``unbroken demo --help`` (plain text, no markup).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..process._exit import EXIT_FAILURE, EXIT_OK
from ..process._logfile import read_metrics


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


DESCRIPTION = """\
Train a small character-level transformer (examples/char_lm.py) twice: once straight
through, once while being killed (SIGKILL and SIGTERM at random moments, one SIGKILL
inside a save) and relaunched. Then compare the two runs, bit for bit: every checkpoint,
the exported weights and the per-step losses. The killing, relaunching and comparing are
what `unbroken verify` runs on your own script. About a minute on 2 CPU cores; --full
trains the example as its own defaults say (larger, bf16 autocast with a GradScaler:
several minutes)."""

# A smaller configuration of the same example for a demo of about a minute on 2 CPU cores:
# shorter windows and batches, fp32 (bf16 autocast is several times slower on most CPUs) and
# one loader worker. Still a transformer, a shuffled mid-epoch loader with a worker, dropout,
# AdamW, an LR schedule and an EMA, resumed through real kills.
QUICK_ARGS = ["--context", "32", "--batch-size", "16", "--workers", "1", "--no-amp"]
QUICK_STEPS, QUICK_SAVE_EVERY = 200, 20
FULL_STEPS, FULL_SAVE_EVERY = 300, 25
PLOT_HINT = "matplotlib is not installed: pip install matplotlib (unbroken's extra [plot]) for it"


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train the example twice (straight, and killed + relaunched) and compare",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="demo-out", help="output directory (default: %(default)s)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps (default: {QUICK_STEPS}; {FULL_STEPS} with --full)",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=None,
        metavar="N",
        help=f"save every N steps (default: {QUICK_SAVE_EVERY}; {FULL_SAVE_EVERY} with --full)",
    )
    p.add_argument("--kills", type=int, default=4, help="interruptions (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="picks the kill moments")
    p.add_argument(
        "--full", action="store_true", help="the example's own configuration (several minutes)"
    )
    p.add_argument("--script", default=None, help="the training script (default: char_lm.py)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG of the loss curves")
    p.set_defaults(func=run)


def _command(args: argparse.Namespace, script: Path) -> tuple[list[str], int]:
    """The command verify launches, and its step count."""
    from ..verify import PLACEHOLDER

    full = args.full or args.script is not None  # a user's script gets no example options
    steps = args.steps or (FULL_STEPS if full else QUICK_STEPS)
    every = args.save_every or (FULL_SAVE_EVERY if full else QUICK_SAVE_EVERY)
    cmd = [sys.executable, str(script), "--run-dir", PLACEHOLDER]
    cmd += ["--steps", str(steps), "--save-every", str(every)]
    return cmd + ([] if full else QUICK_ARGS), steps


class _Ticker:
    """A line now and then while a launch trains (a piped log gets no progress bar)."""

    def __init__(self, every: float = 10.0) -> None:
        self.every, self._last = every, time.monotonic()
        self._label, self._first, self._shown = "", 0, 0

    def __call__(self, label: str, step: int, total: int | None) -> None:
        if label != self._label:  # a new launch: its first steps are the resumed ones
            self._label, self._first, self._shown = label, step, step
            return
        now = time.monotonic()
        if now - self._last < self.every or step <= self._shown:
            return
        self._last, self._shown = now, step
        of = f"/{total}" if total else ""
        print(f"        {label}: step {step}{of}", flush=True)


def run(args: argparse.Namespace) -> int:
    from ..verify import VerifyError, verify_resume

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
    cmd, steps = _command(args, script)
    kills = max(0, args.kills)
    print(
        f"training {steps} steps twice in {out}: straight through (reference/), then "
        f"interrupted {kills} time{'' if kills == 1 else 's'} and relaunched (interrupted/)",
        flush=True,
    )
    try:
        report = verify_resume(
            cmd,
            interrupts=kills,
            seed=args.seed,
            work_dir=out,
            keep=True,
            progress=lambda msg: print(f"      {msg}", flush=True),
            step_progress=_Ticker(),
        )
    except (ConfigError, VerifyError) as e:
        print(f"unbroken demo: {e}", file=sys.stderr)
        return EXIT_FAILURE
    ref_dir, int_dir = out / "reference", out / "interrupted"
    summary = {**final_weights(ref_dir, int_dir), **_losses(ref_dir, int_dir)}
    equal = summary["same_keys"] and summary["tensors_equal"] == summary["tensors"]
    summary["identical"] = report.passed and equal
    _print_table(summary, report)
    if not args.no_plot:
        png = plot(ref_dir, int_dir, out / "demo.png")
        print(f"loss curves: {png}" if png else f"loss curves: skipped; {PLOT_HINT}")
    summary["verify"] = report.as_dict()
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    return EXIT_OK if summary["identical"] else EXIT_FAILURE


def final_weights(ref_dir: Path, other_dir: Path) -> dict[str, Any]:
    """The example's exported model and EMA weights (``final.safetensors``) of both runs:
    verify compared the checkpoints; this is the file a user would ship."""
    import torch
    from safetensors.torch import load_file

    a = load_file(str(ref_dir / "final.safetensors"))
    b = load_file(str(other_dir / "final.safetensors"))
    max_diff, equal = 0.0, 0
    for k in a.keys() & b.keys():
        if torch.equal(a[k], b[k]):
            equal += 1
        elif a[k].shape == b[k].shape:
            max_diff = max(max_diff, (a[k].double() - b[k].double()).abs().max().item())
        else:
            max_diff = float("inf")
    same_keys = a.keys() == b.keys()
    return {
        "tensors": len(a),
        "tensors_equal": equal,
        "max_abs_diff": max_diff,
        "same_keys": same_keys,
    }


def _losses(ref_dir: Path, other_dir: Path) -> dict[str, Any]:
    ta, tb = _trace(ref_dir), _trace(other_dir)
    return {
        "steps": [len(ta), len(tb)],
        "final_loss": [ta[-1]["loss"] if ta else None, tb[-1]["loss"] if tb else None],
        "losses_identical": [r["loss"] for r in ta] == [r["loss"] for r in tb],
    }


def _trace(run_dir: Path) -> list[dict[str, Any]]:
    with open(run_dir / "trace.jsonl") as f:
        return [json.loads(line) for line in f]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir, events=True) if "event" in r]


def _print_table(r: dict[str, Any], report: Any) -> None:
    kills = [i for i in report.interruptions if i.exit_code != 0]  # not those that came late
    signals = [i.signal for i in kills]
    saves = sum(i.during_save for i in kills)
    seconds = report.seconds
    rows = [
        ("optimizer steps", r["steps"][0], r["steps"][1]),
        (
            "launches",
            1,
            f"{report.launches} ({signals.count('SIGKILL')} SIGKILL, "
            f"{signals.count('SIGTERM')} SIGTERM; {saves} during a save)",
        ),
        (
            "resumed from step",
            "-",
            ", ".join("fresh" if s == 0 else str(s) for s in report.resumed_from) or "-",
        ),
        ("final loss", f"{r['final_loss'][0]:.6f}", f"{r['final_loss'][1]:.6f}"),
        ("checkpoints compared", "-", ", ".join(map(str, report.checkpoints_compared)) or "-"),
        ("max |delta param|", "-", f"{r['max_abs_diff']:g}"),
        ("tensors bitwise equal", "-", f"{r['tensors_equal']}/{r['tensors']}"),
        ("losses identical", "-", "yes" if r["losses_identical"] else "NO"),
        (
            "wall time",
            f"{seconds.get('reference', 0):.0f} s",
            f"{seconds.get('interrupted', 0):.0f} s",
        ),
    ]
    print()
    print(f"{'':24}{'uninterrupted':>16}   {'interrupted + resumed'}")
    for name, x, y in rows:
        print(f"{name:24}{x!s:>16}   {y}")
    print()
    if r["identical"]:
        print("RESULT: bit-for-bit identical")
    else:
        print("RESULT: runs DIFFER")
        print(report.summary())


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
