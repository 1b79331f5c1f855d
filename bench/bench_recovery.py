"""Recovery under ``unbroken run``: from kill -9 of the trainer to its next trained step.

    .venv/bin/python bench/bench_recovery.py [--kills N] [--rounds R] [--src LABEL=DIR ...]
                                             [--opts LABEL='--backoff 0' ...]

``unbroken run [opts] -- python examples/char_lm.py --steps 100000 --save-every 1000``: the
trainer child is SIGKILLed at drawn moments (0.3-1.2 s after it logged its first step of the
attempt -- and, when the supervisor runs a warm standby, after the standby waits), N times per
supervisor; then the supervisor is stopped (SIGTERM). Every variant
(a source tree x a set of options) runs once per round, the variants interleaved; medians
(min-max) over every kill, and the first kill of each supervisor apart (it used to pay the
supervisor's import of torch). Phases, from the run directory and the process table (polled
every 2 ms):

  kill -> new child       SIGKILL sent until the supervisor's new child exists (persisting the
                          snapshot, the backoff, the fork) -- or, with a warm standby, until
                          the standby was promoted (its name is no longer standby-waiting)
  child -> resumed        the new process until its ``resume`` event (metrics log): the
                          interpreter, import torch + unbroken, the script's own set-up, opening
                          the run directory, the restore
  resumed -> first step   the first step after the restore is in the metrics log
  kill -> first step      the sum: what a crash costs in wall time

The waiting standby's resident memory (VmRSS) and the CPU time it uses over 5 s of waiting
are sampled once per supervisor, before its first kill, beside the trainer's RSS and the CPU
time the standby took to get there (its set-up: the interpreter, the imports and, for
``--standby deep``, the script up to Run(); the default standby waits before the script).

    .venv/bin/python bench/bench_recovery.py --kills 3 --rounds 2 --seed 5 \
        --opts standby= --opts deep='--standby deep' --opts no-standby=--no-standby

``--src LABEL=DIR`` runs the same bench against another checkout (``PYTHONPATH=DIR``), e.g.
``--src main=/work/main --src branch=.``, to compare side by side.

``--torchrun N``: the command is ``python -m torch.distributed.run --standalone
--nproc_per_node N examples/char_lm.py ...`` (DDP on gloo); the kill is rank 1's, "the child"
is the supervisor's torchrun (promoted: its workers no longer wait), memory and CPU are
summed over the standby torchrun's agent and workers, and the trainer's RSS over its job's.

    .venv/bin/python bench/bench_recovery.py --torchrun 2 --kills 3 --rounds 2 --seed 5 \
        --opts standby= --opts no-standby=--no-standby
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "char_lm.py"
PHASES = ("kill_to_child", "child_to_resumed", "resumed_to_step", "kill_to_step")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


WAITING = "standby-waiting"  # a warm standby's name while it waits (train/_as_standby.py)


def _attempt(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return 1 << 30
    got = [v.split(b"=", 1)[1] for v in env if v.startswith(b"UNBROKEN_ATTEMPT=")]
    return int(got[0]) if got and got[0].isdigit() else 1 << 30


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _launches(pid: int) -> list[int]:
    """The supervisor's children but its persister (supervise/_persister.py), by attempt: the
    trainer, then its warm standby (started with the next attempt's environment)."""
    out = []
    for c in _children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"unbroken.supervise._persister" in f.read():
                    continue
        except OSError:
            continue
        out.append(c)
    return sorted(out, key=lambda c: (_attempt(c), c))


RANKS = 0  # --torchrun N: the command is a torchrun of N workers


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _workers(agent: int) -> list[int]:
    """A torchrun agent's workers (started with ``TORCHELASTIC_RUN_ID``), by pid."""
    out = []
    for p in _tree(agent)[1:]:
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if b"\0TORCHELASTIC_RUN_ID=" in b"\0" + f.read():
                    out.append(p)
        except OSError:
            pass
    return sorted(out)


def _waits(pid: int) -> bool:
    """A launch that waits: a standby process, or a standby torchrun whose workers all wait."""
    if not RANKS:
        return _comm(pid) == WAITING
    ws = _workers(pid)
    return len(ws) == RANKS and all(_comm(w) == WAITING for w in ws)


def _trainers(pid: int) -> list[int]:
    """The supervisor's trainer (a list of one), not its persister nor its standby."""
    kids = [c for c in _launches(pid) if not _waits(c)]
    return kids[:1]


def _standby(pid: int) -> int | None:
    kids = [c for c in _launches(pid) if _waits(c)]
    return kids[0] if kids else None


def _victim(trainer: int) -> int:
    """What is killed: the trainer, or rank 1 of its job."""
    if not RANKS:
        return trainer
    return _wait(lambda: (lambda ws: ws[1] if len(ws) == RANKS else None)(_workers(trainer)))


def _lift_standby(pid: int) -> None:
    """Once a new standby exists (after the measured recovery), put it at the normal priority:
    on a machine busy with other users' work, a standby setting up under SCHED_IDLE may not get
    the CPU for minutes, and the bench measures a recovery *with* a standby ready. (What it
    costs while waiting is measured after it waits; its set-up CPU time is reported.)"""
    kids = _wait(lambda: [c for c in _launches(pid)[1:] if _attempt(c) < 1 << 30])
    if RANKS:  # the standby torchrun's workers, once started
        _wait(lambda: len(_workers(kids[0])) == RANKS)
    for proc in _tree(kids[0]):
        for tid in os.listdir(f"/proc/{proc}/task"):
            try:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass


def _cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants (a torchrun job's agent and workers)."""
    total = 0
    for p in _tree(pid):
        with open(f"/proc/{p}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants."""
    kb = 0
    for p in _tree(pid):
        with open(f"/proc/{p}/status") as f:
            kb += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    return kb / 1024


def _sample_standby(sup: int, trainer: int, seconds: float = 5.0) -> dict:
    """The waiting standby's RSS and its CPU time over ``seconds`` of waiting."""
    spare = _wait(lambda: _standby(sup))
    setup, t0 = _cpu_s(spare), time.monotonic()
    time.sleep(seconds)
    used = _cpu_s(spare) - setup
    return {
        "standby_rss_mb": round(_rss_mb(spare), 1),
        "trainer_rss_mb": round(_rss_mb(trainer), 1),
        "standby_setup_cpu_s": round(setup, 2),
        "standby_wait_cpu_pct": round(100 * used / (time.monotonic() - t0), 3),
    }


def _records(run: Path) -> list[dict]:
    try:
        with open(run / "metrics.jsonl", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line being written
    return out


def _wait(cond, timeout: float = 180.0, every: float = 0.002):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError("the trainer did not get there in time")


def _steps_after(run: Path, n_records: int) -> bool:
    return any("step" in r and "event" not in r for r in _records(run)[n_records:])


def one_supervisor(
    src: str, opts: list[str], kills: int, rng: random.Random, waits: list[dict]
) -> list[dict]:
    """Start a supervisor, SIGKILL its trainer ``kills`` times, stop it; per-kill phases."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    run = tmp / "run"
    env = {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "unbroken", "run", "-q", *opts, "--", sys.executable]
    if RANKS:
        env["OMP_NUM_THREADS"] = "1"
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    cmd += [str(SCRIPT), "--run-dir", str(run)]
    cmd += ["--steps", "100000", "--save-every", "1000"]
    log = open(tmp / "supervisor.log", "wb")
    # cwd: `-m unbroken` must import the tree under test, not the current directory's.
    sup = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=src)
    out = []
    standby = "--no-standby" not in opts
    try:
        _wait(lambda: _steps_after(run, 0), every=0.01)
        for k in range(kills):
            (child,) = _wait(lambda: _trainers(sup.pid))
            if standby:
                _lift_standby(sup.pid)
            if standby and k == 0:
                waits.append(_sample_standby(sup.pid, child))
            elif standby:
                _wait(lambda: _standby(sup.pid))
            time.sleep(rng.uniform(0.3, 1.2))
            victim = _victim(child)
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            new = _wait(lambda: [c for c in _trainers(sup.pid) if c != child])  # noqa: B023
            t_child = time.time()

            def resumed(t: float = t_kill) -> float | None:
                # The relaunch cuts the log back to its checkpoint: look at all of it.
                ev = [r["time"] for r in _records(run) if r.get("event") == "resume"]
                return ev[-1] if ev and ev[-1] >= t - 0.002 else None

            t_resumed = _wait(resumed)
            m = len(_records(run))
            _wait(lambda: _steps_after(run, m))  # noqa: B023
            t_step = time.time()
            out.append(
                {
                    "kill": k,
                    "kill_to_child": t_child - t_kill,
                    "child_to_resumed": t_resumed - t_child,
                    "resumed_to_step": t_step - t_resumed,
                    "kill_to_step": t_step - t_kill,
                    "pids": [child, new[0]],
                }
            )
        sup.send_signal(signal.SIGTERM)
        sup.wait(timeout=120)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        log.close()
    rc = sup.returncode
    if rc not in (0, 75):
        sys.exit(f"supervisor exit {rc}: see {tmp / 'supervisor.log'}")
    subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return out


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=3, help="kills per supervisor")
    p.add_argument("--rounds", type=int, default=2, help="supervisors per variant")
    p.add_argument("--src", action="append", default=[], metavar="LABEL=DIR")
    p.add_argument("--opts", action="append", default=[], metavar="LABEL=OPTIONS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="append the figures to this JSON-lines file")
    p.add_argument("--quick", action="store_true", help="2 kills, 1 supervisor per variant")
    p.add_argument("--torchrun", type=int, default=0, metavar="N", help="N ranks under torchrun")
    a = p.parse_args()
    global RANKS
    RANKS = a.torchrun
    if a.quick:
        a.kills, a.rounds = 2, 1
    srcs = [s.split("=", 1) for s in a.src] or [["branch", str(ROOT)]]
    optsets = [o.split("=", 1) for o in a.opts] or [["defaults", ""]]
    variants = [(f"{sl} {ol}", str(Path(sd).resolve()), shlex.split(od))
                for sl, sd in srcs for ol, od in optsets]  # fmt: skip
    rng = random.Random(a.seed)
    got: dict[str, list[dict]] = {v[0]: [] for v in variants}
    waits: dict[str, list[dict]] = {v[0]: [] for v in variants}
    for r in range(a.rounds):
        for label, src, opts in variants:
            got[label] += one_supervisor(src, opts, a.kills, rng, waits[label])
            print(f"round {r + 1}/{a.rounds} {label}: done", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    what = f"char_lm under torchrun x{RANKS}" if RANKS else "char_lm"
    print(f"\n{what}, {a.kills} kills x {a.rounds} supervisors per variant; load {load:.1f}")
    summary: dict[str, object] = {"bench": "recovery", "load": round(load, 2)}
    print("| variant | " + " | ".join(PHASES) + " | first kill -> step / -> child | later |")
    print("| --- |" + " ---: |" * (len(PHASES) + 2))
    for label, rows in got.items():
        cells = [_fmt([r[ph] for r in rows]) for ph in PHASES]
        first = _fmt([r["kill_to_step"] for r in rows if r["kill"] == 0])
        first += " / " + _fmt([r["kill_to_child"] for r in rows if r["kill"] == 0])
        later = _fmt([r["kill_to_step"] for r in rows if r["kill"] > 0])
        print(f"| {label} | " + " | ".join(cells) + f" | {first} | {later} |")
        summary[label] = {ph: round(statistics.median([r[ph] for r in rows]), 3) for ph in PHASES}
        if waits[label]:
            keys = waits[label][0].keys()
            med = {k: round(statistics.median([w[k] for w in waits[label]]), 3) for k in keys}
            print(f"|   {label}: waiting standby (medians of {len(waits[label])}): {med} |")
            summary[label].update(med)  # type: ignore[attr-defined]
        if a.json:
            with open(a.json, "a", encoding="utf-8") as f:
                rec = {"bench": "recovery", "variant": label, "load": load, "kills": rows}
                rec["standby"] = waits[label]
                f.write(json.dumps(rec) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
