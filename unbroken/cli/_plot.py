"""``unbroken plot RUN``: a PNG of the loss and the other scalars of ``RUN/metrics.jsonl``, one
panel each over the optimizer step, with the points where the run resumed marked.

Reads only the metrics log (never a checkpoint). Needs matplotlib: ``pip install
'unbroken[plot]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError
from ..process._exit import EXIT_OK
from ..process._logfile import METRICS_FILE, read_metrics
from . import _weights

EPILOG = """exit codes: 0 written, 1 the log cannot be read or matplotlib is missing,
            2 usage error (an unknown --keys name), 3 no metrics log in RUN

example: unbroken plot runs/gpt --keys loss,lr --out gpt.png"""

SKIP = {"step", "samples"}  # the x axis; the sample indices are not a scalar


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plot",
        help="PNG of the loss and other logged scalars, resume points marked",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN", help="the run directory")
    p.add_argument("--out", metavar="PNG", help="the image to write (default: RUN/metrics.png)")
    p.add_argument(
        "--keys", metavar="K1,K2", help="the scalars to plot, in order (default: all, loss first)"
    )
    p.add_argument("--json", action="store_true", help="print what was plotted as JSON")
    p.set_defaults(func=lambda a: _weights.run_guarded("plot", run, a))


def scalars(records: list[dict[str, Any]]) -> list[str]:
    """Every key holding a number in some step record; ``loss`` first, then as first logged."""
    keys: dict[str, None] = {}
    for rec in records:
        for k, v in rec.items():
            if k not in SKIP and isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.setdefault(k)
    return sorted(keys, key=lambda k: k != "loss")  # stable: the rest keep their order


def run(args: argparse.Namespace) -> int:
    path = os.path.join(args.run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path} does not exist: is {args.run_dir} a run directory?")
    try:
        log = read_metrics(args.run_dir, events=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    records = [r for r in log if "event" not in r and isinstance(r.get("step"), int)]
    resumes = [int(r["step"]) for r in log if r.get("event") == "resume" and "step" in r]
    available = scalars(records)
    keys = available if not args.keys else [k.strip() for k in args.keys.split(",") if k.strip()]
    unknown = [k for k in keys if k not in available]
    if unknown or not keys:
        raise _weights.UsageError(
            f"{path} logs no scalar {', '.join(unknown) or '(none given)'}; "
            f"it has: {', '.join(available) or 'none'}"
        )
    out = args.out or os.path.join(args.run_dir, "metrics.png")
    draw(records, keys, resumes, out, title=os.path.basename(os.path.abspath(args.run_dir)))
    info = {"png": out, "keys": keys, "steps": len(records), "resumes": resumes}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{out}: {', '.join(keys)} over {len(records)} steps, {len(resumes)} resume(s)")
    return EXIT_OK


def draw(
    records: list[dict[str, Any]], keys: list[str], resumes: list[int], out: str, title: str
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CheckpointError(
            "unbroken plot needs matplotlib: pip install matplotlib (unbroken's extra [plot])"
        ) from None
    fig, axes = plt.subplots(len(keys), 1, sharex=True, figsize=(9, 2.2 + 1.8 * len(keys)))
    axes = [axes] if len(keys) == 1 else list(axes)
    for ax, key in zip(axes, keys, strict=True):
        pts = [(r["step"], float(r[key])) for r in records if _number(r.get(key))]
        ax.plot([s for s, _ in pts], [v for _, v in pts], lw=1.2)
        ax.set_ylabel(key)
        for i, step in enumerate(resumes):
            ax.axvline(step, color="tab:red", lw=0.8, ls=":", label="resumed" if i == 0 else None)
        ax.grid(alpha=0.3)
    if resumes:
        axes[0].legend(loc="upper right")
    axes[0].set_title(f"{title}: {len(records)} steps, {len(resumes)} resume(s)")
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise CheckpointError(f"cannot write {out}: {e}") from None
    finally:
        plt.close(fig)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
