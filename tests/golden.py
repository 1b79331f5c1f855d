"""The shared golden-test helper: uninterrupted vs interrupted-and-resumed, bit for bit.

Every training run happens in its own process; the interrupted one is signalled (SIGTERM,
SIGKILL, ...) and relaunched from fresh objects until it completes. The two runs' final
checkpoints are then compared tensor by tensor with ``torch.equal`` (model, optimizer moments,
EMA, scaler, everything tracked), their JSON state value by value, and their per-step metrics
logs record by record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests import forks
from unbroken import EXIT_RESUMABLE, read_metrics
from unbroken.process import _tree
from unbroken.store import CheckpointStore

ROOT = Path(__file__).resolve().parent.parent
# Fields that legitimately differ between an interrupted and an uninterrupted run.
VOLATILE = {("counters", "train_seconds"), ("counters", "metrics_offset")}


def launch(script: str | Path, args: list[str], timeout: float = 180) -> int:
    """Run ``python SCRIPT ARGS`` to its end (forked from a pre-imported interpreter:
    tests/forks.py) and return its exit code; any code but 0, 75 or a SIGKILL fails the test."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
    try:
        code, out, err = forks.start(script, args, env).wait(timeout)
    except forks.Hung as e:  # with its stacks (faulthandler)
        raise AssertionError(f"{script} {args} ran past {timeout}s\n{e.text[-6000:]}") from None
    if code not in (0, EXIT_RESUMABLE, -signal.SIGKILL):
        raise AssertionError(f"{script} {args} exited {code}\n{out[-3000:]}{err[-5000:]}")
    return code


def is_persister(pid: int) -> bool:
    """Whether ``pid`` is an ``unbroken run`` supervisor's persister process
    (supervise/_persister.py), the supervisor's child beside the command it runs."""
    return b"unbroken.supervise._persister" in _tree.cmdline(pid)


def attempt_of(pid: int) -> int | None:
    """``UNBROKEN_ATTEMPT`` in the environment ``pid`` was started with (None: unreadable, say
    while it is in the middle of ``exec``)."""
    value = _tree.environ_value(pid, "UNBROKEN_ATTEMPT")
    return int(value) if value is not None and value.isdigit() else None


def launches(pid: int) -> list[int]:
    """Supervisor ``pid``'s children but its persister: the command it runs and, beside it,
    its warm standby (supervise/_standby.py), ordered by attempt (unreadable ones last). A child
    whose command line reads empty is exiting (a zombie has none): it is no launch, and it may
    well be the persister the supervisor is closing."""
    kids = []
    for p in _tree.children(pid):
        cmdline = _tree.cmdline(p)
        if cmdline and b"unbroken.supervise._persister" not in cmdline:
            kids.append(p)
    return sorted(kids, key=lambda p: (attempt_of(p) or 1 << 30, p))


def trainers(pid: int) -> list[int]:
    """The command supervisor ``pid`` runs (a list of one, or none): its child of the lowest
    attempt, not its persister and not its warm standby (started with the next attempt's
    environment). A child started with no readable attempt (in the middle of ``exec``) or a
    command that is not a Python process counts only when it is the only one."""
    kids = launches(pid)
    if len(kids) > 1 and attempt_of(kids[0]) is not None:
        return kids[:1]
    return kids


def tree_report(pid: int) -> str:
    """``pid`` and its descendants, one line each -- state, kernel wait channel, scheduling
    policy of every thread (5: SCHED_IDLE), command line -- for the message of a test that
    timed out: where a hung job hangs."""
    lines = []
    for p in [pid, *_tree.descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[:2]
            with open(f"/proc/{p}/wchan") as f:
                wchan = f.read()
            policies = set()
            for tid in os.listdir(f"/proc/{p}/task"):
                try:
                    policies.add(os.sched_getscheduler(int(tid)))
                except OSError:
                    pass
        except OSError:
            continue
        cmd = _tree.cmdline(p).replace(b"\0", b" ").decode(errors="replace")[:160]
        ppid = state[1].decode()
        lines.append(f"{p} (parent {ppid}) {state[0].decode()} {wchan} {sorted(policies)} {cmd}")
    return "\n".join(lines)


def expected_code(sig: str) -> int:
    return -signal.SIGKILL if sig == "KILL" else EXIT_RESUMABLE


def run_interrupted(
    script: str | Path,
    args: list[str],
    run_dir: Path,
    interrupts: list[tuple[Any, ...]],
    resume_args: list[str] | None = None,
    must_resume: bool = True,
) -> None:
    """Run with each interrupt in turn (a fresh process each), then to completion.

    An interrupt is (step, signal) or (step, signal, phase); the phase is understood by
    tests/scripts/interrupt.py ("after" step K, or at the "start" of step K+1). Every launch
    over a run directory that holds a checkpoint must resume from one (its resume event), and
    at least one must (``must_resume=False`` for a test of stops before the first save).
    """
    resumed = 0
    for step, sig, *phase in interrupts:
        extra = ["--signal-phase", phase[0]] if phase else []
        had = has_checkpoint(run_dir)
        code = launch(
            script,
            [*args, "--run-dir", str(run_dir), "--signal-at", str(step), "--signal", sig, *extra],
        )
        assert code == expected_code(sig), f"interrupt at {step} by {sig}: exit {code}"
        resumed += had and check_resumed(run_dir, f"the launch interrupted at step {step}")
    final = resume_args if resume_args is not None else args
    had = bool(interrupts) and has_checkpoint(run_dir)
    assert launch(script, [*final, "--run-dir", str(run_dir)]) == 0
    resumed += had and check_resumed(run_dir, "the final launch")
    # A test whose every interrupt came before the first checkpoint compares no resume: only
    # one that says so (``must_resume=False``: a fresh start after a stop) may do that.
    assert not (interrupts and must_resume) or resumed, (
        f"no relaunch resumed from a checkpoint: {interrupts}"
    )


def has_checkpoint(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any(p.name.startswith("step-") for p in root.iterdir())


def check_resumed(run_dir: Path, which: str) -> bool:
    """A relaunch over a run directory holding a checkpoint resumed from one (its resume event,
    the newest in the log, at a step > 0)."""
    steps = resume_steps(run_dir)
    assert steps and steps[-1] > 0, f"{which} did not resume from a checkpoint: {steps}"
    return True


def final_state(run_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    reader = CheckpointStore(str(run_dir)).latest()
    assert reader is not None, f"no checkpoint in {run_dir}"
    infos = reader.tensor_infos()
    tensors = {k: torch.empty(i.shape, dtype=i.dtype) for k, i in infos.items()}
    reader.load_tensors(tensors)
    trees = {**reader.global_trees(), **(reader.local_trees(0) or {})}
    return tensors, trees


def _strip(trees: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in trees.items()}
    for comp, key in VOLATILE:
        if isinstance(out.get(comp), dict):
            out[comp].pop(key, None)
    return out


def assert_identical(ref_dir: Path, other_dir: Path, ignore: tuple[str, ...] = ()) -> None:
    """Bitwise equality of every tracked tensor, all JSON state and the per-step metrics.

    ``ignore`` names components whose JSON state is not compared (e.g. "rng" when a script
    never seeds Python's and NumPy's streams, which then start from OS entropy in every process).
    """
    ta, ja = final_state(ref_dir)
    tb, jb = final_state(other_dir)
    assert ta.keys() == tb.keys(), f"tensor sets differ: {sorted(ta.keys() ^ tb.keys())}"
    diff = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not diff, f"tensors differ: {diff[:10]}"
    sa, sb = _strip(ja), _strip(jb)
    for comp in sorted((sa.keys() | sb.keys()) - set(ignore)):
        assert sa.get(comp) == sb.get(comp), f"component {comp!r} state differs"
    ma, mb = read_metrics(str(ref_dir)), read_metrics(str(other_dir))
    assert [m["step"] for m in ma] == list(range(1, len(ma) + 1)), "reference log has gaps"
    assert len(ma) == len(mb), f"{len(ma)} vs {len(mb)} logged steps"
    for a, b in zip(ma, mb, strict=True):
        assert a == b, f"step {a.get('step')} logged {a} vs {b}"
    oracle_identical(ref_dir, other_dir)


def _oracle(run_dir: Path) -> tuple[dict[str, torch.Tensor], Any, list[str]]:
    folder = run_dir / "oracle"
    tensors = load_file(str(folder / "final.safetensors"))
    values = json.loads((folder / "final.json").read_text())
    return tensors, values, (folder / "losses.txt").read_text().splitlines()


def oracle_identical(ref_dir: Path, other_dir: Path) -> bool:
    """The scripts' own record of how they ended (tests/scripts/_oracle.py), read back with the
    safetensors library and plain JSON, not through unbroken: every tensor of the model,
    optimizer, EMA, ..., every other value of their state, and one loss per step, 1..N.
    False when the script leaves no record (it does not use the oracle); a record on one side
    only fails."""
    have = [(d / "oracle" / "final.safetensors").exists() for d in (ref_dir, other_dir)]
    if not any(have):
        return False
    assert all(have), (
        f"only one run left its final state: {ref_dir}: {have[0]}, {other_dir}: {have[1]}"
    )
    ta, va, la = _oracle(ref_dir)
    tb, vb, lb = _oracle(other_dir)
    assert ta.keys() == tb.keys(), f"final tensors differ: {sorted(ta.keys() ^ tb.keys())}"
    diff = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not diff, f"final tensors differ (the scripts' own dump): {diff[:10]}"
    assert va == vb, f"final values differ: {sorted(k for k in va if va[k] != vb.get(k))[:10]}"
    steps = [int(line.split()[0]) for line in la]
    assert steps == list(range(1, len(la) + 1)), f"the reference's loss list has gaps: {steps}"
    assert la == lb, f"per-step losses differ: {sorted(set(la) ^ set(lb))[:4]}"
    return True


def logged_steps(run_dir: Path) -> list[int]:
    """The steps the metrics log holds now ([] while it is missing or half written)."""
    try:
        return [r["step"] for r in read_metrics(str(run_dir))]
    except (OSError, ValueError):
        return []


def resume_steps(run_dir: Path) -> list[int]:
    """The steps the run resumed at, in order (the log's resume events)."""
    events = read_metrics(str(run_dir), events=True)
    return [r["step"] for r in events if r.get("event") == "resume"]


def draw_stops(seed: str, steps: int, save_every: int) -> tuple[int, int]:
    """A SIGKILL step after the first checkpoint, and a SIGTERM step after the checkpoint the
    relaunch resumes from: both logged steps, both placed so each relaunch resumes from one."""
    import random

    rng = random.Random(seed)
    kill = rng.randint(save_every + 1, steps - 4)
    term = rng.randint(kill + 1, steps - 2)
    return kill, term


def trainer_state(run_dir: Path) -> dict[str, Any]:
    """The Trainer's saved ``TrainerState`` without the wall-clock fields of its log history."""
    state = final_state(run_dir)[1]["trainer_state"]
    for entry in state["state"]["log_history"]:
        for key in [k for k in entry if k.endswith(("_runtime", "_per_second"))]:
            del entry[key]
    return dict(state)


def supervise_and_kill(
    cmd: list[str], run_dir: Path, moments: list[int], env: dict[str, str], wait: float = 180
) -> tuple[str, list[int], int]:
    """Start ``cmd`` (``unbroken run ... -- TRAINER``) and SIGKILL its trainer once it logged
    each of ``moments``; the supervisor's output, the last step logged before each kill and the
    supervisor's pid.

    Each aim is past the last step the previous trainer logged: a log at or under it may be
    that trainer's, read before its successor resumed (or even started), and a kill then would
    find no trainer, or one still starting (no resume event)."""
    import time

    sup = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    reached: list[int] = []
    child = None
    try:
        for at in moments:
            target = max(at, reached[-1] + 2) if reached else at
            deadline = time.monotonic() + wait
            while True:
                if time.monotonic() > deadline or sup.poll() is not None:
                    raise AssertionError(f"the trainer never reached step {target}")
                now = trainers(sup.pid)
                steps = logged_steps(run_dir)
                if steps and steps[-1] >= target and len(now) == 1 and now[0] != child:
                    break  # the one trainer alive logged a step only it can have logged
                time.sleep(0.01)
            (child,) = now
            os.kill(child, signal.SIGKILL)
            while os.path.exists(f"/proc/{child}") and trainers(sup.pid) == [child]:
                time.sleep(0.005)
            reached.append(logged_steps(run_dir)[-1])
        out, _ = sup.communicate(timeout=300)
    finally:
        if sup.poll() is None:
            sup.kill()
    text = out.decode(errors="replace")
    assert sup.returncode == 0, text[-4000:]
    return text, reached, sup.pid


def assert_resumed_within_a_step(run_dir: Path, reached: list[int], said: str) -> None:
    """One resume per kill, each from at most one step before the last step logged."""
    resumes = resume_steps(run_dir)
    assert len(resumes) == len(reached), (resumes, reached, said[-3000:])
    for last, resumed in zip(reached, resumes, strict=True):
        assert last - 1 <= resumed <= last, (reached, resumes)
