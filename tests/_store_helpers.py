"""Shared helpers of the store's acceptance tests: a tiny training state, restore, damage.

Run as a script it is the kill -9 driver of ``test_store_kill.py`` (see :func:`_sweep`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import faults  # noqa: E402
from unbroken.state import Counters, GlobalRNG, Registry, _rng
from unbroken.store import (
    CheckpointReader,
    CheckpointStore,
    Retention,
    WriterLock,
    _fsops,
    _manifest,
)

Snapshot = tuple[Any, dict[str, torch.Tensor]]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- a tiny training state --------------------------------------------------------------------


def make_registry(seed: int = 0) -> Registry:
    """Model + AdamW + cosine scheduler + global RNG + counters, as a trainer tracks them."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    reg = Registry()
    reg.add("model", model)
    reg.add("optimizer", opt)
    reg.add("scheduler", sched)
    reg.add("rng", GlobalRNG())
    reg.add("counters", Counters())
    return reg


def train(reg: Registry, steps: int) -> None:
    model, opt, sched, counters = (
        reg.get(n) for n in ("model", "optimizer", "scheduler", "counters")
    )
    g = torch.Generator().manual_seed(1000 + counters.step)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        counters.step += 1
        counters.samples += 5


def save(store: CheckpointStore, reg: Registry) -> str:
    step = reg.get("counters").step
    return store.save(step, reg.collect(), {"epoch": 0, "samples": reg.get("counters").samples})


def snapshot(reg: Registry) -> Snapshot:
    """Everything a checkpoint of ``reg`` holds: JSON trees and tensor copies."""
    p = reg.collect()
    trees = json.loads(_manifest.dumps({"global": p.global_trees, "local": p.local_trees}))
    return trees, {k: v.detach().clone() for k, v in p.tensors.items()}


def restore(reader: CheckpointReader, fresh: Callable[..., Registry] | None = None) -> Snapshot:
    """Load ``reader`` into fresh objects (the start-up path; ``fresh(seed=...)`` makes them,
    default :func:`make_registry`) and snapshot what they hold.

    The global RNG of this process is put back afterwards: restoring sets it.
    """
    reg = (fresh or make_registry)(seed=123)
    mine = _rng.capture()
    try:
        trees = {**reader.global_trees(), **(reader.local_trees(0) or {})}
        names = reg.check_names(trees)
        targets = reg.plan(names, trees, reader.tensor_infos())
        reader.load_tensors(targets)
        reg.restore(names, trees, targets)
        return snapshot(reg)
    finally:
        _rng.restore(mine)


def assert_same(got: Snapshot, want: Snapshot) -> None:
    assert got[0] == want[0], "JSON state differs"
    assert sorted(got[1]) == sorted(want[1]), "tensor names differ"
    for k, t in want[1].items():
        assert got[1][k].dtype == t.dtype and torch.equal(got[1][k], t), f"tensor {k} differs"


def dump_snapshot(path: str, snap: Snapshot) -> None:
    with open(path + ".json", "w") as f:
        json.dump(snap[0], f)
    torch.save(snap[1], path + ".pt")


def load_snapshot(path: str) -> Snapshot:
    with open(path + ".json") as f:
        trees = json.load(f)
    return trees, torch.load(path + ".pt", weights_only=True)


def make_run(run: str, steps: tuple[int, ...] = (1, 2), **retention: Any) -> dict[int, Snapshot]:
    """Commit a checkpoint at each of ``steps``; returns the snapshot saved at each."""
    reg = make_registry()
    store = CheckpointStore(run, Retention(keep_last=None, **retention))
    snaps = {}
    for s in steps:
        train(reg, s - reg.get("counters").step)
        save(store, reg)
        snaps[s] = snapshot(reg)
    return snaps


# ---- inspecting a run directory ---------------------------------------------------------------


def ckpt(run: str, step: int) -> str:
    return os.path.join(run, "checkpoints", f"step-{step:09d}")


def entries(run: str) -> list[str]:
    return sorted(os.listdir(os.path.join(run, "checkpoints")))


def transients(run: str) -> list[str]:
    return [e for e in entries(run) if e.startswith((".tmp-", ".del-", ".old-"))]


def latest(store: CheckpointStore) -> tuple[CheckpointReader | None, list[str]]:
    """``store.latest()`` and the warnings it logged."""
    from tests._logs import logged  # not at the top: this file also runs as a script

    with logged() as caught:
        r = store.latest()
    return r, caught


# ---- faults -----------------------------------------------------------------------------------


@contextmanager
def hook(fn: Callable[[str, str], None]) -> Iterator[None]:
    old = _fsops.set_hook(fn)
    try:
        yield
    finally:
        _fsops.set_hook(old)


def recorder(events: list[tuple[str, str]]) -> Callable[[str, str], None]:
    return lambda name, path: events.append((name, path))


def fail_at(k: int, code: int, reached: list[tuple[str, str]]) -> Callable[[str, str], None]:
    """A hook raising OSError(code) at the k-th event (1-based); ``reached`` gets that event."""
    count = [0]

    def fn(name: str, path: str) -> None:
        count[0] += 1
        if count[0] == k:
            reached.append((name, path))
            raise OSError(code, os.strerror(code), path)

    return fn


def fail_at_event(event: str, code: int, reached: list[str], nth: int = 1) -> Callable[..., None]:
    seen = [0]

    def fn(name: str, path: str) -> None:
        if name == event:
            seen[0] += 1
            if seen[0] == nth:
                reached.append(path)
                raise OSError(code, os.strerror(code), path)

    return fn


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (e.g. on a FIFO that something opens)."""

    def on_alarm(*_: object) -> None:
        raise TimeoutError(f"did not finish within {seconds} s (blocked on a FIFO?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---- crafting damaged and malicious checkpoints -----------------------------------------------


class Evil:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def evil_pickle(marker: str) -> bytes:
    return pickle.dumps(Evil(marker), protocol=2)


def read_manifest_raw(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def write_manifest_raw(path: str, m: dict[str, Any]) -> None:
    """Write ``m`` as the manifest, with a correct self-checksum (a crafted, consistent file)."""
    m = dict(m)
    m[_manifest.SELF_CHECKSUM] = _manifest.self_checksum(m)
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(_manifest.dumps(m))


def refresh_manifest(path: str, *names: str) -> None:
    """Make the manifest's size and xxh3 of ``names`` match the files as they are now."""
    m = read_manifest_raw(path)
    for name in names:
        with open(os.path.join(path, name), "rb") as f:
            raw = f.read()
        m["files"][name] = {"size": len(raw), "xxh3_64": xxhash.xxh3_64_hexdigest(raw)}
    write_manifest_raw(path, m)


# ---- the kill -9 driver -----------------------------------------------------------------------

SCENARIOS = ("new", "resave")


def _child(run: str, reg: Registry, rng: dict[str, Any], env: dict[str, str]) -> None:
    """In a forked child: take the lock, arm the fault from the environment, save, retain."""
    code = 1
    try:
        _rng.restore(rng)  # os.fork() reseeds Python's global random in the child
        lock = WriterLock(run)
        lock.acquire()
        _fsops.set_hook(faults.hook(env.get(faults.PLAN_ENV), env.get(faults.LOG_ENV)))
        store = CheckpointStore(run, Retention(keep_last=1))
        store.save(2, reg.collect(), {"epoch": 0})
        store.apply_retention(2)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _template(out: str, scenario: str) -> tuple[str, Registry]:
    """Commit A (step 1) [and B (step 2) for ``resave``]; returns the run and the state to save.

    ``new``: the save under test is B at step 2. ``resave``: step 2 is saved again with new
    content C (a resumed run saving the step it loaded).
    """
    template = os.path.join(out, "template")
    reg = make_registry()
    store = CheckpointStore(template, Retention(keep_last=None))
    train(reg, 1)
    save(store, reg)
    dump_snapshot(os.path.join(out, "expect-1"), snapshot(reg))
    train(reg, 1)
    if scenario == "resave":
        save(store, reg)
        dump_snapshot(os.path.join(out, "expect-2-old"), snapshot(reg))
        train(reg, 1)
        reg.get("counters").step = 2
    dump_snapshot(os.path.join(out, "expect-2"), snapshot(reg))
    return template, reg


def _forked(jobs: list[tuple[str, dict[str, str]]], template: str, reg: Registry, width: int):
    """Run a child per (run name, env), ``width`` at a time; {name: (pid, exit code)}."""
    rng = _rng.capture()
    out = os.path.dirname(template)
    running: dict[int, str] = {}
    done: dict[str, tuple[int, int]] = {}
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < width:
            name, env = pending.pop(0)
            run = os.path.join(out, name)
            shutil.copytree(template, run)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(run, reg, rng, env)
            running[pid] = name
        pid, status = os.wait()
        done[running.pop(pid)] = (pid, os.waitstatus_to_exitcode(status))
    return done


def _sweep(out: str, scenario: str) -> dict[str, Any]:
    """Save step 2 once to record its events, then once per event K under ``kill:K``."""
    os.makedirs(out)
    template, reg = _template(out, scenario)
    rec_log = os.path.join(out, "record.log")
    _, rec_code = _forked([("record", {"UNBROKEN_FAULT_LOG": rec_log})], template, reg, 1)["record"]
    with open(rec_log) as f:
        events = [line.rstrip("\n").split("\t") for line in f]
    jobs = [
        (f"kill-{k:03d}", {"UNBROKEN_FAULT": f"kill:{k}", "UNBROKEN_FAULT_LOG": f"{out}/{k}.log"})
        for k in range(1, len(events) + 1)
    ]
    done = _forked(jobs, template, reg, width=4)
    kills = []
    for k in range(1, len(events) + 1):
        with open(f"{out}/{k}.log") as f:
            last = f.read().splitlines()[-1].split("\t")
        pid, code = done[f"kill-{k:03d}"]
        kills.append({"k": k, "run": f"{out}/kill-{k:03d}", "pid": pid, "code": code, "last": last})
    return {"record": rec_code, "events": events, "kills": kills, "out": out}


if __name__ == "__main__":
    torch.set_num_threads(1)  # fork after a parallel region is safe only without OpenMP threads
    result = {sc: _sweep(os.path.join(sys.argv[1], sc), sc) for sc in SCENARIOS}
    with open(os.path.join(sys.argv[1], "result.json"), "w") as f:
        json.dump(result, f)


# ---- crafting non-regular files -----------------------------------------------------------------


def fifo_for(name: str) -> Callable[[str], None]:
    """Replace ``name`` of a checkpoint directory by a FIFO."""

    def craft(d: str) -> None:
        os.remove(os.path.join(d, name))
        os.mkfifo(os.path.join(d, name))

    return craft


def symlink_for(name: str) -> Callable[[str], None]:
    """Replace ``name`` by a symlink to a valid copy outside the directory."""

    def craft(d: str) -> None:
        outside = os.path.join(os.path.dirname(d), "copy-" + name)
        shutil.copy(os.path.join(d, name), outside)
        os.remove(os.path.join(d, name))
        os.symlink(outside, os.path.join(d, name))

    return craft
