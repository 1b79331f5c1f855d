"""Stop markers: each process that saved and stopped says so, for whoever launched the job.

A launcher between the supervisor and the ranks loses their exit code: torchrun exits 1 when
its ranks exit 75 ("saved and stopped, relaunch me"). So a process that stops that way also
writes a marker into the launch's stop directory (:mod:`unbroken.process._protocol`: set per launch
by ``unbroken run`` and ``unbroken verify``), and the launcher of the job reads them: when every
rank wrote one, the launch stopped resumably whatever the launcher's exit code says. A marker
is written after the stop's checkpoint committed (the commit is collective: every rank's part
is in it), or by a process stopped while not training (nothing to save).

A process that ends by an uncaught exception leaves a *crash record* there too
(:func:`record_crash`, from the ``sys.excepthook`` that ``import unbroken`` wraps under ``unbroken
run``): the exception's type and the innermost frame of its traceback. The supervisor compares
one crash's with the next (:func:`failure`): the same failure over and over is a bug, and it
stops relaunching it.

Torch-free: the supervisor reads markers without importing torch.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from types import TracebackType
from typing import Any

from . import _protocol

ENV = _protocol.STOP_DIR

_log = logging.getLogger("unbroken.run")


def _env_int(*names: str, default: int) -> int:
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return default


def _whoami(rank: int | None, world: int | None) -> dict[str, Any]:
    if rank is None:
        rank = _env_int("RANK", "SLURM_PROCID", default=0)
    if world is None:
        world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    return {
        "rank": rank,
        "world_size": world,
        "local_rank": _env_int("LOCAL_RANK", "SLURM_LOCALID", default=rank),
        "local_world_size": _env_int("LOCAL_WORLD_SIZE", default=world),
        "node": _env_int("GROUP_RANK", "SLURM_NODEID", default=0),
        "restart": _env_int("TORCHELASTIC_RESTART_COUNT", default=0),
        "pid": os.getpid(),
    }


def record(
    step: int | None, reason: str, rank: int | None = None, world: int | None = None
) -> None:
    """Write this process's stop marker, if a launcher asked for markers (never raises: a
    marker that cannot be written costs a crash retry, not the stop)."""
    where = os.environ.get(ENV)
    if not where:
        return
    marker = {**_whoami(rank, world), "step": step, "reason": reason}
    _write(where, _protocol.STOP_MARKER.format(rank=marker["rank"]), marker, "the stop marker")


def record_crash(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Write this process's crash record, if a launcher asked for markers: the exception's
    type and the innermost frame of its traceback, where it was raised (never raises). One per
    rank: a process of the rank that fails later (the script after its child) replaces it."""
    where = os.environ.get(ENV)
    if not where:
        return
    try:
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        code = tb.tb_frame.f_code if tb is not None else None
        module = getattr(kind, "__module__", "builtins")
        name = getattr(kind, "__qualname__", str(kind))
        crash = {
            **_whoami(None, None),
            "type": name if module == "builtins" else f"{module}.{name}",
            "file": code.co_filename if code is not None else "",
            "line": tb.tb_lineno if tb is not None else 0,
            "function": code.co_name if code is not None else "",
            "message": str(value)[:300],
            "time": time.time(),
        }
    except Exception:  # an exit goes on: the record is a courtesy to the supervisor
        return
    _write(where, CRASH_RECORD.format(rank=crash["rank"]), crash, "the crash record")


def record_uncaught() -> None:
    """Record every uncaught exception of the main thread (a wrapper around the
    ``sys.excepthook`` in place, which still prints the traceback; idempotent)."""
    if getattr(sys.excepthook, "_unbroken_crash", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        record_crash(kind, value, tb)
        if _standby_failed(kind, value, tb):
            return  # the supervisor says it, in one line: not a traceback from a spare
        previous(kind, value, tb)

    hook._unbroken_crash = True  # type: ignore[attr-defined]
    sys.excepthook = hook


FAILED = "failed before Run()"
"""How the reason of a deep standby that failed before its wait point begins (:func:`refuse`)."""


def _standby_failed(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> bool:
    """In a deep warm standby not yet promoted (it runs the script up to ``Run()`` beside the
    trainer): an exception there is the script's set-up failing a second time beside the
    trainer -- a fixed port already bound (the DDP tutorial's ``MASTER_PORT``), a file held --
    not the job's failure. Leave the reason for the supervisor, which says it once and keeps
    a shallow standby instead; True when so (no traceback is printed)."""
    from . import _signals

    if not _signals.IN_STANDBY:
        return False
    try:
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
        message = str(value)[:300]
        name = getattr(kind, "__qualname__", str(kind))
        refuse(
            f"{FAILED}: {name}{': ' + message if message else ''}{where} -- the script's "
            "set-up cannot run twice beside the trainer"
        )
    except Exception:
        return False
    return True


CRASH_RECORD = "crash-{rank:05d}.json"


def failure(where: str) -> dict[str, Any] | None:
    """The launch's failure, from its crash records: the first rank's to fail (by its record's
    time) -- but only when every rank of the job is accounted for, by a crash record or a stop
    marker. A rank killed from outside leaves neither, and its peers then fail on the lost
    connection with exceptions of their own, which are not the job's failure; a job over
    several nodes shows this node's ranks only. None when unknown."""
    crashes = _read(where, "crash-")
    if not crashes:
        return None
    ranks = {m.get("rank") for m in crashes} | {m.get("rank") for m in read(where)}
    sizes = {m.get("world_size") for m in crashes}
    if len(sizes) != 1:
        return None
    (size,) = sizes
    if not isinstance(size, int) or size < 1 or not set(range(size)) <= ranks:
        return None
    return min(crashes, key=lambda m: m.get("time") or 0.0)


def _write(where: str, name: str, obj: dict[str, Any], what: str) -> None:
    """``obj`` as ``where/name``, whole or not at all (a reader never sees half a file);
    a failure is warned about, never raised."""
    path = os.path.join(where, name)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(where, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except OSError as e:
        _log.warning("unbroken: could not write %s %s: %s", what, path, e)


REFUSED = "standby-refused.json"


def refuse(reason: str) -> None:
    """In a deep warm standby that will not wait (train/_as_standby.py): say why, for the
    supervisor, which keeps a shallow standby instead (never raises)."""
    where = os.environ.get(ENV)
    if where:
        _write(where, REFUSED, {"reason": reason, "pid": os.getpid()}, "the standby's refusal")


def refusal(where: str) -> str | None:
    """Why the standby whose stop directory is ``where`` refused to wait (None: it did not)."""
    try:
        with open(os.path.join(where, REFUSED), encoding="utf-8") as f:
            reason = json.load(f).get("reason")
    except (OSError, ValueError, AttributeError):
        return None
    return str(reason) if reason else None


RUN_DIR_FILE = "run-dir.json"


def tell_run_dir(run_dir: str, schedule: dict[str, int | None] | None = None) -> None:
    """Tell the launcher which run directory this launch trains in, beside the stop markers
    (read with :func:`unbroken.process._shm.read_channel`, the format of a snapshot area's channel).
    A supervisor with no snapshot area (``--no-snapshots``, or areas refused) has no other
    channel, and judges whether a crash made progress by that directory's checkpoints. Never
    raises: unknown, a crash counts as one without progress (retried with a backoff).

    ``schedule`` (``max_steps``, ``save_every``) goes with it: ``unbroken verify`` plans its
    interruptions from it while the reference run is still training (:func:`read_schedule`)."""
    where = os.environ.get(ENV)
    if where:
        told = {"run_dir": os.path.abspath(run_dir), **(schedule or {})}
        _write(where, RUN_DIR_FILE, told, "the run directory")


def read_schedule(where: str) -> tuple[int, int | None] | None:
    """``(max_steps, save_every)`` a launch told in ``where`` (:func:`tell_run_dir`), or None
    while it has not, or when it trains without ``max_steps``."""
    try:
        with open(os.path.join(where, RUN_DIR_FILE), encoding="utf-8") as f:
            told = json.load(f)
    except (OSError, ValueError):
        return None
    total, every = told.get("max_steps"), told.get("save_every")
    if not isinstance(total, int) or isinstance(total, bool) or total < 1:
        return None
    return total, every if isinstance(every, int) and every > 0 else None


def read(where: str) -> list[dict[str, Any]]:
    """The stop markers in ``where``."""
    return _read(where, "rank-")


def _read(where: str, prefix: str) -> list[dict[str, Any]]:
    out = []
    try:
        names = sorted(os.listdir(where))
    except OSError:
        return []
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(where, name), encoding="utf-8") as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue
    return out


def all_stopped(where: str) -> str | None:
    """A description ("2 of 2 ranks saved and stopped at step 6") when every rank of the launch
    left a marker -- or, in a launch over several nodes, every rank of this node (the others
    wrote theirs on their own nodes; the stop's checkpoint is collective) -- else None."""
    markers = read(where)
    if not markers:
        return None
    latest = max(m.get("restart", 0) for m in markers)
    markers = [m for m in markers if m.get("restart", 0) == latest]  # torchrun's last round
    world = {m.get("world_size") for m in markers}
    if len(world) != 1:
        return None
    (size,) = world
    if not isinstance(size, int) or size < 1:
        return None
    steps = sorted({m["step"] for m in markers if isinstance(m.get("step"), int)})
    at = f" at step {steps[-1]}" if steps else ""
    if {m.get("rank") for m in markers} == set(range(size)):
        return f"{size} of {size} ranks saved and stopped{at}"
    local = {m.get("local_world_size") for m in markers}
    nodes = {m.get("node") for m in markers}
    if len(local) == 1 and len(nodes) == 1:
        (n,) = local
        if isinstance(n, int) and {m.get("local_rank") for m in markers} == set(range(n)):
            return f"the {n} ranks of this node (of {size}) saved and stopped{at}"
    return None
