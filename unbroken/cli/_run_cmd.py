"""``unbroken run``: supervise a training command -- relaunch on exit 75, retry crashes, requeue.

The options and the report; the supervisor itself is ``unbroken/supervise/_supervisor.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict
from typing import Any

from ..process import _protocol, _shm
from ..process._exit import EXIT_USAGE
from ..supervise import _job, _standby
from ..supervise._supervisor import (
    FORWARDED,
    Supervisor,
    _dur,
    _nonneg,
    _say,
    _signame,
    slurm_job_id,
    startup,
)

DESCRIPTION = f"""Run CMD and keep it running until it finishes.

  exit 0            done; unbroken run exits 0
  exit 75           resumable (saved and stopped): relaunch at once; under SLURM,
                    `scontrol requeue` the job instead and exit 75
  killed by SIGTERM resumable too: CMD was stopped before it handled signals (while
                    importing, say), so nothing was training; also SIGINT/SIGUSR1
                    when the supervisor forwarded them
  anything else     a crash (non-zero exit or killed by a signal): relaunch after a
                    backoff (--backoff, doubling up to --max-backoff), at most
                    --max-retries times in a row; a crash run resets when an attempt
                    exits 75, made progress (two steps or more) or ran longer than
                    --reset-after seconds -- but the same failure (the same exception at
                    the same line, or the same fault signal) more than --max-retries times
                    in a row is a bug: given up on, and named, whatever the progress

Every relaunch counts toward --max-restarts. SIGTERM, SIGINT, SIGUSR1 and SIGHUP are
forwarded to CMD and every process under it that handles them -- under torchrun to every
rank, not to torchrun itself -- which should save and exit 75; after a stop signal nothing is
relaunched (under SLURM the job is still requeued). Ctrl-C is not forwarded a second time to
processes the terminal already delivered it to. CMD sees {_protocol.ATTEMPT}=<n> (1-based, per
supervisor) and {_protocol.SUPERVISED}=1.

Launchers (torchrun): when every rank saved and stopped, the attempt is resumable whatever
CMD's exit code (torchrun exits 1); each rank says so in {_protocol.STOP_DIR}. Processes CMD
leaves running (the ranks of a killed torchrun, still saving) are waited for, up to --grace
seconds, before anything is relaunched.

Warm standby (with snapshots; for `python SCRIPT`, `python -m MODULE` and `torchrun
--standalone`): once CMD opened its Run, a python with torch and unbroken imported starts
beside it and waits, before the script; it runs the script when CMD dies, without a process
start. Nothing of the script runs outside the process that trains. --standby deep: a second
CMD that runs the script up to its first Run() and waits there (its set-up saved too, but its
side effects happen twice, beside the trainer); --no-standby: off. Said at start-up.

SLURM (SLURM_JOB_ID set, --no-requeue not given): the job requeued is
${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}} for array jobs, else SLURM_JOB_ID; if
scontrol is missing or fails, the failure is reported and CMD is relaunched in place. In a
multi-node job (SLURM_JOB_NUM_NODES > 1) the job is requeued once per stop, by the first node
left to claim it (a file in the shared run directory, RUN/.unbroken.requeue-JOB.RESTART); the
others exit 75.
Use `exec unbroken run ...` in the batch script so `#SBATCH --signal=B:USR1@120` reaches it."""

EPILOG = """exit codes:
  0   CMD finished (exit 0)
  1   could not start CMD, or CMD's last crash was a death by signal
  2   usage error
  75  resumable: stopped by a signal, SLURM job requeued, or --max-restarts reached
  N   CMD's own exit code when it crashed and the retries ran out (or a stop came)

example: unbroken run --json report.json -- python train.py --config c.yaml"""

NUMERIC_OPTIONS: list[tuple[str, type[int] | type[float], float, str, str]] = [
    ("--max-restarts", int, 100, "N", "relaunches in total, resumable or crash (default 100)"),
    ("--max-retries", int, 3, "N", "crashes in a row that are retried (default 3)"),
    ("--backoff", float, 1.0, "SEC", "wait before a crash retry, doubling (default 1)"),
    ("--max-backoff", float, 60.0, "SEC", "longest wait before a crash retry (default 60)"),
    ("--reset-after", float, 600.0, "SEC", "an attempt this long ends a crash run (default 600)"),
]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a training command; relaunch on exit 75, retry crashes, requeue on SLURM",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, kind, default, metavar, text in NUMERIC_OPTIONS:
        p.add_argument(flag, type=_nonneg(kind), default=default, metavar=metavar, help=text)
    p.add_argument(
        "--grace",
        type=_nonneg(float),
        default=300.0,
        metavar="SEC",
        help="after CMD fails, how long the processes it left running (ranks of a killed "
        "launcher, still saving) may take to stop before they are killed (default 300)",
    )
    p.add_argument("--no-requeue", action="store_true", help="under SLURM, relaunch in place")
    p.add_argument(
        "--no-snapshots",
        action="store_true",
        help="no in-memory snapshots (a crash then loses the steps since the last save)",
    )
    p.add_argument(
        "--standby",
        choices=_standby.DEPTHS,
        help="the warm standby, a process that takes over when the trainer dies with no process "
        "start on the way: 'imports' (the default) waits before the script with torch and "
        "unbroken imported, and nothing of the script runs before its turn (CMD must be python "
        "SCRIPT or python -m MODULE); 'deep' (formerly 'run') runs CMD up to the script's first "
        "Run() and waits there, its set-up done -- but what the script does before Run() "
        "happens twice, beside the trainer (files, downloads, memory, GPU memory); 'off'. See "
        "docs/supervise.md",
    )
    p.add_argument("--no-standby", action="store_true", help="the same as --standby off")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument(
        "cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to supervise"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]  # argparse keeps the separator in a REMAINDER argument
    if not cmd:
        print(
            "unbroken run: error: no command given (unbroken run [options] -- CMD ARGS...)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    sup = Supervisor(args, cmd)
    if not args.quiet:
        for line in startup(args, sup):
            _say(line)
    try:
        sup.tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        pass  # no controlling terminal: nothing can deliver Ctrl-C to the child but us
    old = {s: signal.signal(s, sup._on_signal) for s in FORWARDED}
    t0 = time.monotonic()
    if sup.shm is not None:
        sup.persister.start()  # imports the store while the first trainer starts
    if sup.shm is not None and _shm.any_stale():
        # Left by a supervisor that was killed itself: keep what it held, then free it.
        from ..store.snapshot._area import reap_stale

        for step, where in reap_stale():
            _say(f"kept the in-memory snapshot of step {step} left in {where}")
    try:
        code, outcome = sup.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if sup.tty is not None:
            os.close(sup.tty)
        if sup.launch is not None:
            sup.launch.kill()  # the supervisor failed itself: leave no rank behind
        sup.standby.close()
        sup.persister.close()
        if sup.shm is not None:
            sup.shm.discard()
        _job.discard(sup.stops)
    elapsed = time.monotonic() - t0
    restarts = max(len(sup.attempts) - 1, 0)
    if not args.quiet:
        _say(f"report for {shlex.join(cmd)}")
        for att in sup.attempts:
            _say("  " + att.line(args.max_retries))
    _say(
        f"{outcome}; exit {code} after {len(sup.attempts)} attempt(s), "
        f"{restarts} restart(s), {_dur(elapsed)}"
    )
    if args.json:
        report = {
            "command": cmd,
            "exit_code": code,
            "outcome": outcome,
            "restarts": restarts,
            "elapsed_s": round(elapsed, 3),
            "stop_signal": _signame(sup.stop) if sup.stop else None,
            "slurm_job": None if args.no_requeue else slurm_job_id(os.environ),
            "requeued": bool(sup.attempts) and sup.attempts[-1].action.startswith("requeue"),
            "attempts": [asdict(att) for att in sup.attempts],
        }
        tmp = f"{args.json}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.json)  # a reader never sees half a report
    return code
