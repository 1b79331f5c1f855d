"""Thin helpers over torch.distributed that are no-ops in a single process.

The collectives unbroken issues itself (stop agreement, commit verdict, resume choice) have
bounded waits: NCCL (and a gloo peer that is alive but stuck elsewhere) makes a collective
with a dead rank hang rather than fail. Each is issued asynchronously and polled until
:data:`TIMEOUT` seconds; then every rank that gave up leaves a mark in the run directory
(:func:`set_report_dir`), waits a short grace for the others' marks, and raises
:class:`CollectiveTimeoutError` naming the ranks that left none.

A dead rank is not always an error in the ops that wait for it: gloo may drop its connection
to a killed peer and still never fail the pending op (seen after a lost node: both survivors
waited the whole TIMEOUT in a commit verdict), and a survivor waiting on another survivor that
is stuck elsewhere is not told at all. So every rank also beats (:class:`_Liveness`: a counter
in the job's rendezvous store, once a second, from a thread of its own), and a wait that runs
long reads the others' counters: a rank whose counter stood still while this one's own moved
:data:`STALE_BEATS` times is dead (or its node lost), and the wait ends there, naming it.
Counting in this rank's own beats, not in seconds, keeps a suspended job (SIGSTOP on every
process, then SIGCONT) from reading as dead; a rank that never beat is not judged (it may be
starting slowly), and an unreachable store means the rank or agent that held it is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import CollectiveTimeoutError
from .process import _quick_exit

T = TypeVar("T")
log = logging.getLogger(__name__)

TIMEOUT = 600.0
"""Seconds a rank waits in one of unbroken's collectives before it names who did not answer."""
GRACE = 10.0
"""Seconds a rank that gave up waits for the others' marks (they give up at about the same
time: each started the same collective)."""
BEAT = 1.0
"""Seconds between two beats of a rank (:class:`_Liveness`)."""
STALE_BEATS = 15
"""A rank is dead when its counter stood still over this many beats of the waiting rank."""
WATCHDOG_BEATS = 30
"""Beats without a ``run.step()`` after which a dead rank ends this process (_Liveness)."""
FIRST_LOOK = 5.0
"""Seconds a collective may take before the waiting rank first looks at the others' beats."""
_report_dir: str | None = None
# Per kind of collective: each kind is issued in the same order on every rank (the commit
# verdict of a background save runs beside the training thread's stop agreement).
_seq: dict[str, itertools.count[int]] = {}


def set_report_dir(path: str | None) -> None:
    """Where ranks leave their marks after a timed-out collective (the run directory)."""
    global _report_dir
    _report_dir = path


def set_timeout(seconds: float) -> None:
    global TIMEOUT
    TIMEOUT = float(seconds)


def bounded(work: Any, what: str, timeout: float | None = None) -> None:
    """Wait for the async collective ``work`` at most ``timeout`` seconds (default
    :data:`TIMEOUT`); then raise CollectiveTimeoutError naming the ranks that did not answer."""
    seq = next(_seq.setdefault(what, itertools.count()))
    limit = TIMEOUT if timeout is None else timeout
    if not _wait(work, limit, what):
        missing = _who_is_missing(f"{seq}-{what}")
        who = (
            f"rank(s) {', '.join(map(str, missing))} did not answer"
            if missing
            else "every rank answered late (the collective itself is stuck)"
            if missing == []
            else "which rank did not answer is unknown (no run directory to compare in)"
        )
        raise CollectiveTimeoutError(
            f"rank {rank()}: the {what} did not complete within {limit:g} s: {who}. A "
            "rank that died or hangs elsewhere stops the others here; look at its log, "
            "then relaunch (every rank resumes from the last checkpoint)",
            missing=missing,
        )


def _wait(work: Any, limit: float, what: str) -> bool:
    """Whether ``work`` completed within ``limit`` seconds (its own error is raised; a dead
    peer seen through the beats raises CollectiveTimeoutError)."""
    start = time.monotonic()
    end, look = start + limit, start + FIRST_LOOK
    if _blocking_wait is not False:
        # gloo's wait() takes a timeout and blocks without polling; NCCL's returns at once
        # (it only orders the streams), so there the completion is polled. In slices: between
        # two, the others' beats are read.
        while True:
            now = time.monotonic()
            if now >= end:
                return False
            try:
                work.wait(timeout=timedelta(seconds=max(0.001, min(end, look) - now)))
                if work.is_completed():
                    return True
            except RuntimeError as e:
                if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                    raise
            look = _look(what, look)
    pause = 0.0001
    while not work.is_completed():
        now = time.monotonic()
        if now >= end:
            return False
        if now >= look:
            look = _look(what, look)
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    work.wait()  # raises the backend's own error, if the collective failed
    return True


def _look(what: str, look: float) -> float:
    """Raise if a rank is dead (:class:`_Liveness`); the time of the next look."""
    if _liveness is None:
        return float("inf")
    if time.monotonic() < look:
        return look
    dead, who = _liveness.verdict()
    if who:
        raise CollectiveTimeoutError(
            f"rank {rank()}: the {what} cannot complete: {who} (dead, or its node lost). "
            "Relaunch: every rank resumes from the last checkpoint",
            missing=dead or None,
        )
    # Every waiting rank reads every rank's key: past 64 ranks, less often, so that a
    # thousand ranks waiting on a slow one send the store ~64 thousand reads a second at most.
    return time.monotonic() + BEAT * max(1, _liveness.world // 64)


_blocking_wait: bool | None = None  # None: try wait(timeout) first (gloo); False: poll only


def _who_is_missing(tag: str) -> list[int] | None:
    """The ranks that left no mark for ``tag`` within the grace (None: nowhere to look)."""
    if _report_dir is None:
        return None
    launch = "-".join(
        os.environ.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")
    )  # marks of an earlier launch of this run must not count
    d = os.path.join(_report_dir, ".unbroken-timeouts", f"{launch}-{tag}".replace(os.sep, "_"))
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"rank-{rank()}"), "w"):
            pass
    except OSError:
        return None
    world = world_size()
    end = time.monotonic() + GRACE
    while True:
        try:
            here = {int(n.split("-")[1]) for n in os.listdir(d) if n.startswith("rank-")}
        except (OSError, ValueError):
            return None
        missing = [r for r in range(world) if r not in here]
        if not missing or time.monotonic() >= end:
            return missing
        time.sleep(0.1)


class _Liveness:
    """This rank's beats and its reading of the others' (see the module's docstring), through
    the job's rendezvous store (``MASTER_ADDR``/``MASTER_PORT``: the store rank 0 or
    torchrun's agent holds), under keys of this launch.

    While a Run trains (:func:`watch`), the beating thread is also a watchdog for the
    collectives that are not unbroken's (DDP's, FSDP's, the script's own): when the training
    thread has not reached ``run.step()`` for :data:`WATCHDOG_BEATS` beats and a rank is dead,
    nothing this process waits for can complete (gloo would wait its 30-minute timeout, NCCL
    its own), so it says which rank and ends the process (exit 1), for the job to be relaunched
    from the newest snapshot or checkpoint."""

    def __init__(self, store: Any, prefix: str, me: int, world: int) -> None:
        self.keys = [f"{prefix}/{r}" for r in range(world)]
        self.me, self.world, self.pid = me, world, os.getpid()
        self.beats = 0  # this rank's own, counted here (what staleness is measured in)
        self.seen: dict[int, tuple[int, int]] = {}  # rank -> (its counter, my beats then)
        self.unread = 0  # looks in a row that could not read the store
        self.watching = False
        self.stepped_at = 0  # this rank's beats at its last run.step()
        self._lock = threading.Lock()  # dead() is called by the waits and by the watchdog
        self._beat_store, self._read_store = store, store.clone()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unbroken-beat", daemon=True)
        self._beat_store.add(self.keys[me], 1)
        self._thread.start()

    def _run(self) -> None:
        spacing = max(1, self.world // 64)
        while not self._stop.wait(BEAT):
            try:
                self._beat_store.add(self.keys[self.me], 1)
            except Exception:  # the store is gone: dead() says so after three looks
                pass
            self.beats += 1
            idle = self.beats - self.stepped_at
            if self.watching and idle >= WATCHDOG_BEATS and idle % spacing == 0:
                self._watchdog(idle)

    def _watchdog(self, idle: int) -> None:
        _, who = self.verdict()
        if not who or not self.watching:
            return
        log.error(
            "unbroken: rank %d: %s (dead, or its node lost) while this rank has not reached "
            "run.step() for %d s: nothing it waits for can complete; ending this process "
            "(exit 1) so that the job can be relaunched, instead of waiting for the "
            "backend's timeout. UNBROKEN_LIVENESS=0 turns this off (e.g. while a debugger "
            "holds a rank)",
            self.me,
            who,
            int(idle * BEAT),
        )
        for h in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                h.flush()
        os._exit(1)

    def verdict(self) -> tuple[list[int], str]:
        """The dead ranks and what to say of them ("" while every rank looks alive)."""
        dead, why = self.dead()
        return dead, f"rank(s) {', '.join(map(str, dead))} stopped beating" if dead else why

    def dead(self) -> tuple[list[int], str]:
        """The ranks whose counters stood still over STALE_BEATS of this rank's beats, and
        why no rank can be judged when the store cannot be read."""
        with self._lock:
            try:
                values = [int(v) for v in self._read_store.multi_get(self.keys)]
            except Exception as e:  # three looks in a row: not a slow answer, the holder is gone
                self.unread += 1
                if self.unread < 3:
                    return [], ""
                return [], f"the job's rendezvous store cannot be read ({type(e).__name__}: {e})"
            self.unread = 0
            out = []
            for r, v in enumerate(values):
                if r == self.me or v <= 0:
                    continue  # never beat (maybe starting slowly), or ended: not judged
                last = self.seen.get(r)
                if last is None or last[0] != v:
                    self.seen[r] = (v, self.beats)
                elif self.beats - last[1] >= STALE_BEATS:
                    out.append(r)
            return out, ""

    def close(self) -> None:
        """At exit: stop beating and say so (a rank that ended is not dead). Not in a process
        forked from this one (a DataLoader worker's exit is not the rank's)."""
        if os.getpid() != self.pid:
            return
        self.watching = False
        self._stop.set()
        self._thread.join(timeout=2 * BEAT)
        with contextlib.suppress(Exception):
            self._beat_store.set(self.keys[self.me], "-1")


_liveness: _Liveness | None = None
_liveness_pid = -1


def start_liveness() -> None:
    """Start this rank's beats (idempotent; a forked process starts its own). Without a
    rendezvous store to reach (an init_method other than env://), or with
    ``UNBROKEN_LIVENESS=0``, the waits go without."""
    global _liveness, _liveness_pid
    if not active() or world_size() < 2 or _liveness_pid == os.getpid():
        return
    _liveness_pid = os.getpid()
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or os.environ.get("UNBROKEN_LIVENESS", "1") == "0":
        _liveness = None
        return
    launch = "-".join(
        os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
    )
    try:
        store = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=10),
            wait_for_workers=False,
        )  # fmt: skip
        _liveness = _Liveness(store, f"unbroken/beat/{launch}", rank(), world_size())
    except Exception as e:  # no store where the environment says: the waits go without
        _liveness = None
        log.debug("unbroken: no beats (%s)", e)
        return
    atexit.register(_liveness.close)  # before the interpreter's teardown, the thread joined


def watch(on: bool) -> None:
    """Turn the watchdog on (a Run trains) or off (it closed): :class:`_Liveness`."""
    if _liveness is not None and _liveness_pid == os.getpid():
        _liveness.stepped_at = _liveness.beats
        _liveness.watching = on


def stepped() -> None:
    """The training thread reached ``run.step()`` (the watchdog's progress mark)."""
    if _liveness is not None:
        _liveness.stepped_at = _liveness.beats


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def barrier(group: Any = None, what: str = "barrier") -> None:
    if active():
        bounded(dist.barrier(group=group, async_op=True), what)


def all_gather_object(obj: T, group: Any = None) -> list[T]:
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: T, src: int = 0, what: str = "broadcast", group: Any = None) -> T:
    """``obj`` of rank ``src`` on every rank, as JSON: a resume decision or a number, never
    pickled, so nothing a peer sends can execute code (tuples arrive as lists). ``group``: a
    snapshot's own group, whose collectives run beside the training's (src is a global rank)."""
    if not active():
        return obj
    device = _device(group)
    data = json.dumps(obj).encode() if rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    bounded(dist.broadcast(size, src=src, group=group, async_op=True), what)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if rank() == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    bounded(dist.broadcast(buf, src=src, group=group, async_op=True), what)
    if rank() == src:
        return obj
    out: T = json.loads(buf.cpu().numpy().tobytes())
    return out


def all_gather_json(obj: T, what: str = "gather", group: Any = None) -> list[T]:
    """``obj`` of every rank, in rank order, as JSON (never pickled: see broadcast_object)."""
    if not active():
        return [obj]
    device = _device(group)
    data = json.dumps(obj).encode()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size())]
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    bounded(dist.all_gather(sizes, mine, group=group, async_op=True), what)
    most = max(int(s.item()) for s in sizes)
    buf = torch.zeros(most, dtype=torch.uint8, device=device)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(most, dtype=torch.uint8, device=device) for _ in range(world_size())]
    bounded(dist.all_gather(parts, buf, group=group, async_op=True), what)
    return [
        json.loads(p[: int(s.item())].cpu().numpy().tobytes())
        for p, s in zip(parts, sizes, strict=True)
    ]


def any_true(flag: bool, group: Any = None, what: str = "agreement") -> bool:
    """True on every rank if ``flag`` is true on any rank (an agreement point)."""
    if not active():
        return flag
    device = _device(group)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    bounded(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True), what)
    return bool(t.item())


def sum_floats(values: list[float], what: str = "stop agreement") -> list[float]:
    """Element-wise sum over ranks, in float64 (one collective)."""
    if not active():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    bounded(dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True), what)
    return [float(v) for v in t.tolist()]


def new_cpu_group() -> Any:
    """A gloo group over all ranks, for collectives of a background save (collective call)."""
    if not active():
        return None
    return dist.new_group(backend="gloo")


def _device(group: Any = None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_exit_guarded = False


def clean_exit() -> None:
    """Make this process's exit safe from the backend's teardown: a finished or stopped rank
    exits with its own status (0, 75, ...), never with the abort that a gloo group left alive
    into the interpreter's teardown can cause ("terminate called without an active exception",
    -6: a gloo thread dropping the last reference to a tensor needs the GIL, which a finalizing
    interpreter no longer hands out; the same in C++ static destructors). Called by
    ``init_distributed()`` and by ``Run()`` when several ranks train; idempotent.

    At exit (``atexit``, interpreter alive, every save thread joined): destroy the process
    groups and collect the garbage that still holds them, so their threads are joined now;
    then have C's ``exit()`` end the process with its status before the native libraries'
    static destructors run (glibc ``on_exit``, registered last so it runs first).
    """
    global _exit_guarded
    if _exit_guarded or not active() or dist.get_world_size() < 2:
        return
    _exit_guarded = True
    atexit.register(_teardown)


def _teardown() -> None:
    if active():
        try:
            dist.destroy_process_group()
        except Exception:  # an exit goes on: a group that cannot be destroyed is skipped
            pass
    gc.collect()
    _quick_exit.skip_native_destructors()
