"""``unbroken verify``: run a training command straight through and again while interrupting it,
and check that both end bit for bit alike."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from types import FrameType
from typing import Any

from ..process import _protocol
from ..process._exit import EXIT_FAILURE, EXIT_OK, EXIT_USAGE

DESCRIPTION = f"""Check that CMD resumes exactly: run it uninterrupted to completion in a fresh
run directory (the reference), then again in another one while interrupting it K times
(SIGKILL and SIGTERM at moments drawn from --seed; with K >= 2 one SIGKILL lands inside a
save), relaunching it until it exits 0. Then compare every tracked tensor (bitwise, or with
--atol/--rtol) and all saved state at every checkpoint step both runs hold, and the per-step
metrics log; fields that measure time (train_seconds, the Trainer's *_runtime and
*_per_second, ...) are left out and listed as not compared. Reports PASS, or the first step
and the exact component and key that differ, where the runs part relative to the resumes,
and hints at the likely cause, ranked from there.

The interrupted run trains beside the reference where the machine has 2 cores or more
(--one-at-a-time: after it), planned from the max_steps and save_every its Run reports. The
reference starts CMD as a new process; every launch of the interrupted run (the one killed
during a save too) is forked from an interpreter that imported torch once, as a new process
that starts from scratch or resumes from the run directory, and the comparison runs in a fork
of it too (--no-fork: every launch a new process; only `python SCRIPT.py ...` and `python -m
MODULE ...` can be forked). The report says which launch was which.

CMD must use unbroken.Run and take its run directory from the placeholder {{run_dir}} in its
arguments (replaced by each run's directory) or from the environment variable
{_protocol.RUN_DIR}. {_protocol.KEEP_ALL}=1 is set so that every checkpoint is kept. CMD must exit
0 when complete and 75 when stopped after saving (what unbroken.Run does)."""

EPILOG = """exit codes: 0 PASS, 1 the runs differ or CMD failed, 2 usage error (a bad option or
            a command that cannot be started)

example: unbroken verify --interrupts 4 -- python train.py --run-dir {run_dir} --steps 200"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check that a training command resumes bit for bit (run it twice, interrupt one)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--interrupts", type=int, default=3, metavar="K", help="(default: 3)")
    p.add_argument("--seed", type=int, default=0, help="draws the moments (default: 0)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default: bitwise)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default: bitwise)")
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="COMPONENT[.KEY]",
        help="leave out of the comparison (repeatable), e.g. rng.python or metrics.throughput",
    )
    p.add_argument(
        "--work", metavar="DIR", help="keep the run directories here (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir after a PASS")
    p.add_argument("--timeout", type=float, metavar="SEC", help="limit for both runs together")
    p.add_argument(
        "--no-fork",
        action="store_true",
        help="start every launch as a new process (default: relaunches forked, see above)",
    )
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run the interrupted run after the reference, not beside it (a GPU one run fills)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("unbroken verify: give the training command after --", file=sys.stderr)
        return EXIT_USAGE
    from ..errors import ConfigError
    from ..verify import VerifyError, verify_resume  # no torch: the comparison imports it

    bar = _StepBar() if not args.quiet and sys.stderr.isatty() else None

    def progress(msg: str) -> None:
        if bar is not None:
            bar.close()  # a phase ended: its line replaces the bar
        print(f"unbroken verify: {msg}", file=sys.stderr, flush=True)

    if not args.quiet:
        progress(f"checking {shlex.join(cmd)}")
    # The command runs in its own session, out of reach of a signal sent to us: exit through
    # Python so that the launch in flight is killed on the way out (SIGINT already does).
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        report = verify_resume(
            cmd,
            interrupts=args.interrupts,
            seed=args.seed,
            atol=args.atol,
            rtol=args.rtol,
            work_dir=args.work,
            timeout=args.timeout,
            ignore=tuple(args.ignore),
            keep=args.keep,
            progress=None if args.quiet else progress,
            step_progress=bar,
            fork=not args.no_fork,
            side_by_side=False if args.one_at_a_time else None,
        )
    except (ConfigError, VerifyError) as e:
        if args.json:
            print(json.dumps({"passed": False, "error": str(e), "command": cmd}, indent=2))
        print(f"unbroken verify: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, ConfigError) else EXIT_FAILURE
    finally:
        signal.signal(signal.SIGTERM, previous)
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, allow_nan=False))
    else:
        print(report.summary())
    return EXIT_OK if report.passed else EXIT_FAILURE


class _StepBar:
    """A tqdm bar of the launch in progress (its label, the step it logged, the total)."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._label = ""

    def __call__(self, label: str, step: int, total: int | None) -> None:
        from tqdm import tqdm

        if self._bar is None or label != self._label:
            self.close()
            self._label = label
            self._bar = tqdm(total=total, desc=label, unit="step", leave=False, file=sys.stderr)
        self._bar.update(max(0, step - self._bar.n))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
