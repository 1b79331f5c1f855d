"""In-memory snapshots of a run (see unbroken/store/snapshot/_area.py for what they are).

Active only under ``unbroken run`` (which hands the trainer a snapshot area through the process
protocol) and when ``snapshot_every`` is not 0. ``snapshot_every=None`` (the default) snapshots
every step when that costs at most ``BUDGET`` of the step time, else picks the interval that
keeps it there, and says which once. Every rank takes part in every snapshot (the store's save
is collective), so the interval is decided on rank 0 and broadcast once.

By default (``snapshot_copy="step"``) exact by construction: at the end of step N the
training collects the state (``collect()``: the components' state dicts, live tensors) and
copies every tensor, there and then, into buffers of its own kept from one snapshot to the next
(:meth:`Snapshots._copy_all`, one ``torch._foreach_copy_``) -- a plain copy of the state of
step N; the JSON trees are copied too (:func:`_copy_tree`). What follows is off the step's path,
in the thread, while step N+1 computes: the copy into the free slot, hashing it, the table and
JSON files, the copy to the buddy node, the commit. Nothing is watched: no version counter, no
hook, no patch of torch. (A first version had the training wait for the thread's copy into the
slot itself: one copy fewer, but the thread's wake-up and its work before the copy were then
on the step's path -- 4% of char_lm's step at load 9-15, against 0.9% for the background copy.)

``snapshot_copy="background"`` (opt-in) also takes the copy off the step's path: the training
copies at the step's end only the few tensors it may change before the next optimizer step
(buffers such as BatchNorm's statistics, anything not held by a tracked optimizer). The thread
copies the rest -- the parameters and the optimizer's state, which nothing changes before the
next ``optimizer.step()`` -- into the free slot while step N+1 runs its forward and backward
passes; a hook before every ``optimizer.step()`` waits for that copy to be complete
(:meth:`_Job.judge`), and checks with torch's version counters, and the ``Tensor.data`` /
``.numpy()`` watch (train/_data_watch.py), that none of the tensors it copied changed
meanwhile. Only then is the slot hashed and the snapshot committed (still in the thread). A
tensor that did change under the copy (changed in place by something other than the
optimizer) makes that snapshot torn: it is not committed -- the previous one stays the newest
-- and the tensor is copied at the step's end from then on. Changes that move no version
counter and escape the watch are not seen (docs/design.md lists them).

Either way the next ``run.step()`` waits for the commit before it logs its step
(:meth:`Snapshots.committed`), so a step the log shows is a step whose predecessor is in a
snapshot: a crash loses at most one step.
"""

from __future__ import annotations

import copy as _copy
import functools
import math
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import _dist
from ..process import _log, _stops
from ..state import Payload
from ..state._ema import BEFORE_UPDATE, EMA
from ..store import CheckpointReader
from ..store.snapshot._area import SnapshotArea, SnapshotsOff, SnapshotTorn
from ..store.snapshot._nodes import NodeLayout
from . import _data_watch

log = _log.get()
BUDGET = 0.01
"""Snapshots may cost this fraction of the step time (on the step's path)."""
MEASURED = 5
"""Snapshots taken every step, and timed, before ``snapshot_every=None`` picks the interval."""
KEPT = 256
"""Timings kept (bench/bench_snapshot_step.py reads them); no more: a run may be long."""

Collect = Callable[[], tuple[Any, dict[str, Any]]]
"""Returns (payload, meta) of the state as it is now: what a checkpoint of this step holds."""


def interval_for(cost_s: float, step_s: float) -> int:
    """Snapshot every this many steps: every step when one costs at most ``BUDGET`` of a step,
    else as often as keeps their cost within it."""
    if cost_s <= BUDGET * step_s:
        return 1
    return math.ceil(cost_s / (BUDGET * max(step_s, 1e-6)))


def say_nodes(nodes: int) -> None:
    """Said at start-up by each node's first rank (a decision, on stderr)."""
    _log.say(
        log,
        "in-memory snapshots across %d nodes: each node keeps its ranks' part and a copy of the "
        "previous node's (at most one lost node loses at most one step)",
        nodes,
    )


class _Changed(Exception):
    """Raised in the snapshot's thread: tensors it copied changed before the copy was judged."""


class _Job:
    """One snapshot in flight, between the step that took it and its commit."""

    def __init__(self, step: int, payload: Any, meta: dict[str, Any], watch: list) -> None:
        self.step, self.payload, self.meta = step, payload, meta
        self.watch: list[tuple[str, torch.Tensor, int]] = watch  # (key, live tensor, version)
        self.copied = threading.Event()  # every watched tensor is in the slot (or never will be)
        self.judged = threading.Event()
        self.lock = threading.Lock()
        self.commit: Callable[[], None] | None = None  # one process: the rename, for judge()
        self.ready = False  # every file written, waiting for the verdict
        self.renamed = False
        self.commit_error: BaseException | None = None
        self.reached = threading.Event()  # committed, or given up
        self.done = threading.Event()  # and the previous snapshot deleted
        self.gated = False
        self.ungated = False  # committed without passing the gate: a write path not through it
        self.watch_count = len(watch)
        self.changed: list[str] = []
        self.replaced: list[str] = []  # keys whose tensor's .data was set under the copy
        self.outcome = ""  # "committed", "torn", "off"
        self.error: BaseException | None = None
        self.waited = 0.0  # seconds the training waited for it (before its optimizer step)
        self.cost = 0.0  # seconds it took the step that took it

    def watch_alias(self, keys: list[str], alias: torch.Tensor) -> None:
        """The training's side: ``alias`` (a ``.data`` of a copied tensor) was made during the
        copy: a change through it is a change of the tensor (train/_data_watch.py)."""
        with self.lock:
            if keys and not self.judged.is_set():
                version = alias._version
                self.watch.extend((k, alias, version) for k in keys)

    def mark_changed(self, keys: list[str]) -> None:
        """The training's side: ``.data`` of a copied tensor is being replaced."""
        with self.lock:
            if keys and not self.judged.is_set():
                self.replaced.extend(keys)

    def copied_all(self) -> None:
        """The thread's side: every tensor is in the slot."""
        self.copied.set()

    def gate_judged(self) -> bool:
        """The thread's side, before the commit: wait for the training's verdict. In one
        process, once every file is written the training renames the snapshot into place
        itself when it judges (:meth:`judge`): the commit then waits for no thread to wake.
        True when it did."""
        with self.lock:
            self.gated = True
            self.copied.set()  # every file is written (a rank with no tensors copied none)
            self.ready = self.commit is not None
        self.judged.wait()
        if self.changed:
            raise _Changed(f"changed during the snapshot's copy: {', '.join(self.changed[:5])}")
        if self.commit_error is not None:
            raise self.commit_error
        return self.renamed

    def judge(self) -> None:
        """The training's side, where it changes none of the tensors (before an optimizer
        step, at the next ``run.step()``): wait until the copy is complete, then compare every
        copied tensor's version counter with the one it had when the snapshot was taken. A
        change that completed before this point shows; none can be under way (the training is
        here, and CPU ops complete before they return; a GPU's are copied to the host, waited
        for, before the copy counts as complete)."""
        if self.judged.is_set():
            return
        t0 = time.perf_counter()
        self.copied.wait()
        # Waiting for the thread counts as wall time; the checks and the rename as this
        # thread's CPU time (see after_step: not the other processes of a busy node).
        self.waited += time.perf_counter() - t0
        t0 = time.thread_time()
        with self.lock:
            changed = [k for k, t, v in self.watch if t._version != v] + self.replaced
            self.changed = list(dict.fromkeys(changed))
            self.watch = []
            if self.ready and not self.changed and self.commit is not None:
                try:
                    self.commit()  # a rename: the snapshot is committed
                    self.renamed = True
                    self.reached.set()
                except BaseException as e:  # raised in the thread, which reports it
                    self.commit_error = e
            self.judged.set()
        self.waited += time.thread_time() - t0


class _Gate:
    """What the slots call in the snapshot's thread (store/_slots.py)."""

    def __init__(self, job: _Job) -> None:
        self.copied = job.copied_all


class Snapshots:
    def __init__(
        self,
        root: str | None,
        every: int | None,
        *,
        rank: int,
        run_dir: str,
        schedule: dict[str, int | None] | None = None,
        copy: str = "step",
    ) -> None:
        self.rank, self.run_dir = rank, run_dir
        self.copy = copy  # "step": copied in the step; "background": by the thread (see above)
        self.area: SnapshotArea | None = None
        self.interval = every
        self.seconds: float | None = None
        self.taken = 0
        self.group: Any = None  # the snapshots' own collectives, beside the training's
        self.optimizers: list[Any] = []  # their params and state change only in their step()
        self.emas: list[EMA] = []  # their shadows change only in their update()
        self._sync: set[str] = set()  # keys copied at the step's end (they changed under one)
        self._job: _Job | None = None
        self._queue: queue.SimpleQueue[_Job | None] | None = None
        self._thread: threading.Thread | None = None
        self._hook: Any = None
        self._costs: list[float] = []  # what each background snapshot cost the step (s)
        self._step_s = 0.0  # the step time (a cautious estimate), for the interval's choice
        self._background = True  # the thread may be used (False once it failed)
        self._bufs: dict[str, torch.Tensor] = {}  # snapshot_copy="step": the copies, reused
        self._watch: _data_watch.Watch | None = None  # .data of what the thread copies
        if root and every != 0:
            try:
                self.area = SnapshotArea(root, clean=rank == 0)
            except SnapshotsOff as e:  # not a private area (another user's, a link, ...)
                log.warning("unbroken: in-memory snapshots are off: %s", e)
            # Every rank or none (a snapshot is collective); also: rank 0 cleaned first.
            if _dist.any_true(self.area is None):
                self.area = None
            elif _dist.active():
                self._spread(root)
                if self.area is not None and self.area.group is None:
                    self.group = _dist.new_cpu_group()  # collective on every rank
        if self.area is not None:
            # At once, not at the first snapshot: a run that saves durably at every step takes
            # none, and the supervisor still judges a crash's progress by this directory.
            self.area.tell(run_dir)
            if copy == "background" and rank == 0:
                _log.say(
                    log,
                    "in-memory snapshots copied in the background (snapshot_copy='background'): "
                    "a change to the state before the next optimizer step that moves no version "
                    "counter and escapes the Tensor.data/.numpy() watch is not seen (NumPy "
                    "arrays made earlier, untyped_storage(), DLPack, raw pointers, "
                    "torch.compile's eager backend): such a snapshot is torn (docs/design.md)",
                )
        elif os.environ.get("LOCAL_RANK", "0") == "0":
            # No area (--no-snapshots, refused, off): the launch's stop directory is the channel.
            _stops.tell_run_dir(run_dir, schedule)

    def _spread(self, root: str) -> None:
        """Ranks under several supervisors (one per node, each with its own area): each node
        commits its part of every snapshot, with a copy of the previous node's part, so any
        one node can be lost (store/snapshot/_nodes.py)."""
        assert self.area is not None
        layout = NodeLayout.of(_dist.all_gather_json(root, what="snapshot areas"), self.rank)
        if layout is None:
            return  # one area: whole snapshots, as in one process
        if layout.leader and self.rank != 0:
            self.area.store.clean_stale()  # rank 0 cleaned its own node's area at its creation
        # Collective on every rank; gloo whatever the training's backend: the copies are of
        # host memory (the snapshot's files). Also the group of every collective of a
        # snapshot taken in the background.
        self.area.across_nodes(layout, _dist.new_cpu_group())
        if layout.leader:
            say_nodes(layout.nodes)

    def track(self, components: Iterable[Any]) -> None:
        """The tracked optimizers (torch.optim) and EMAs: whose tensors change only in their
        ``step()`` and ``update()`` (which wait for the copy), so are copied in the background."""
        objs = list(components)
        self.optimizers = [o for o in objs if isinstance(o, torch.optim.Optimizer)]
        self.emas = [o for o in objs if isinstance(o, EMA)]

    @property
    def active(self) -> bool:
        return self.area is not None

    @property
    def idle(self) -> bool:
        """No area and no snapshot in flight: ``committed``, ``settle`` and ``after_step`` do
        nothing (an area is only made at the start; a job only with an area)."""
        return self.area is None and self._job is None

    def after_step(
        self, step: int, saved: bool, collect: Collect, step_seconds: float | None
    ) -> float:
        """Called by every rank at the end of each step (after any durable save); returns the
        seconds it took (not training time)."""
        t0 = time.perf_counter()
        self.settle()
        if self.area is None or saved:
            return time.perf_counter() - t0  # (saved: a durable checkpoint of this step exists)
        if self.interval is not None and step % self.interval:
            return time.perf_counter() - t0
        t1 = time.perf_counter()
        # The training thread's own time in the snapshot, as CPU time: what the snapshot costs
        # the step, not the other processes that the scheduler runs meanwhile on a busy node
        # (the waits for the snapshot's thread are counted as wall time, in settle()).
        c1 = time.thread_time()
        self._step_s = step_seconds or 0.0
        payload, meta = collect()
        meta = {**meta, "run_dir": self.run_dir, "snapshot": True}
        # A GPU's tensors stay in the step's path (staged through pinned buffers, as before):
        # the thread's copy would be ordered after its own stream, not after the stream the
        # training stepped on.
        if (
            self.taken
            and self._background
            and not _on_gpu(payload.tensors.values())
            and (self.copy == "step" or self._watching())
        ):
            job = self._start(step, payload, meta)
            job.cost = time.thread_time() - c1
            return time.perf_counter() - t0
        # In the step's path: the first one (it sizes the slots and checks they fit), and all
        # of them after a background one failed.
        if self.taken == 0 and not self._fits(payload):
            return time.perf_counter() - t0
        if self.area.save(step, payload, meta, group=self.group) is None:
            self.area = None  # memory ran out: said, and off on every rank (the store agreed)
            return time.perf_counter() - t0
        self.taken += 1
        self.seconds = time.perf_counter() - t1
        if self.taken == 1 and self.interval is not None and self.rank == 0:
            _log.say(log, "in-memory snapshot every %d step(s) (snapshot_every)", self.interval)
        return time.perf_counter() - t0

    # ---- in the background ------------------------------------------------------------------

    def _watching(self) -> bool:
        """Whether changes through ``Tensor.data`` can be seen (train/_data_watch.py): else
        the snapshots are copied in the step's path."""
        if self._watch is None:
            why = _data_watch.install()
            if why is not None:
                log.warning(
                    "unbroken: in-memory snapshots are taken in the step's path: changes "
                    "through Tensor.data cannot be watched in this torch (%s)",
                    why,
                )
                self._background = False
                return False
            self._watch = _data_watch.Watch()
        return True

    def _start(self, step: int, payload: Any, meta: dict[str, Any]) -> _Job:
        if self.copy == "step":
            # Every tensor copied here, in the step: the thread writes the copies.
            job = _Job(step, self._own_trees(payload, self._copy_all(payload.tensors)), meta, [])
            # Nothing to wait for or judge: the copies are the snapshot's own. The thread
            # commits as soon as every file is written, while the next step computes.
            job.copied.set()
            job.judged.set()
        else:
            job = self._start_background(step, payload, meta)
        assert self.area is not None
        if self.area.layout is None and not _dist.active():
            job.commit = functools.partial(self.area.store.rename_into_place, step)
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._work, name="unbroken-snapshot", daemon=True
            )
            self._thread.start()
            if self.copy == "background":
                # Before every optimizer step, any optimizer: ours are among them, and a check
                # with nothing in flight is one attribute read.
                self._hook = register_optimizer_step_pre_hook(self._before_step)
                BEFORE_UPDATE.append(self._before_update)
        self._job = job
        assert self._queue is not None
        self._queue.put(job)
        return job

    def _copy_all(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of every tensor, made now: into buffers kept from one snapshot to the next
        (free again once the previous snapshot is done: :meth:`settle` came first), a plain
        CPU tensor's; a fresh clone of any other (a subclass keeps its type)."""
        out: dict[str, torch.Tensor] = {}
        dsts, srcs = [], []
        bufs = self._bufs
        for key, t in tensors.items():
            t = t.detach()
            if (
                type(t) is not torch.Tensor
                or t.device.type != "cpu"
                or t.layout != torch.strided
                or t.is_quantized
            ):
                out[key] = t.clone()
                continue
            buf = bufs.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = bufs[key] = torch.empty(t.shape, dtype=t.dtype)
            dsts.append(buf)
            srcs.append(t)
            out[key] = buf
        for key in bufs.keys() - out.keys():  # tensors gone from the state: their buffers too
            del bufs[key]
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return out

    @staticmethod
    def _own_trees(payload: Any, tensors: dict[str, torch.Tensor]) -> Payload:
        """The payload the thread writes: ``tensors``, and the JSON trees as they are now (a
        copy: a tree the training changes in the next step is not what this step held)."""
        return Payload(
            global_trees=_copy_tree(payload.global_trees),
            local_trees=_copy_tree(payload.local_trees),
            tensors=tensors,
            kinds=dict(payload.kinds),
        )

    def _start_background(self, step: int, payload: Any, meta: dict[str, Any]) -> _Job:
        assert self._watch is not None
        new = self._watch.exposed - self._sync
        if new:
            self._sync.update(new)
            log.info(
                "unbroken: %s shared with NumPy (.numpy()): copied at the step's end from now on",
                ", ".join(sorted(new)[:5]),
            )
        live = [(t, _ptr(t)) for t in self._live()]
        owned = {ptr for _, ptr in live}
        owned.discard(0)
        tensors: dict[str, torch.Tensor] = {}
        watch = []
        ptrs = []
        for key, t in payload.tensors.items():
            ptr = 0 if key in self._sync else _ptr(t)
            if ptr not in owned:
                # May change before the next optimizer step (a buffer, a fresh tensor the
                # thread would race with nothing -- a clone is cheap for those): copied now.
                t = t.detach().clone()
            else:
                watch.append((key, t, t._version))
                ptrs.append(ptr)
            tensors[key] = t
        job = _Job(step, self._own_trees(payload, tensors), meta, watch)
        # Before the training runs again: a .data taken from now on is seen.
        self._watch.begin(job, live, watch, ptrs)
        job.watch_count = len(watch)
        return job

    def _live(self) -> list[torch.Tensor]:
        """The tracked optimizers' parameters and state and the EMAs' shadows, as the training
        holds them."""
        out: list[torch.Tensor] = []
        for opt in self.optimizers:
            for group in opt.param_groups:
                out.extend(group["params"])
            for st in opt.state.values():
                out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        for ema in self.emas:
            out.extend(ema.shadow.values())
        return out

    def _before_step(self, *_: Any) -> None:
        job = self._job
        if job is not None:
            job.judge()

    def _before_update(self) -> None:
        job = self._job
        if job is not None:
            job.judge()

    def _work(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            if job is None:
                return
            area = self.area
            try:
                assert area is not None
                area.slots.gate = _Gate(job)
                path = area.save(
                    job.step,
                    job.payload,
                    job.meta,
                    group=self.group,
                    torn=functools.partial(self._torn, job),
                    before_commit=job.gate_judged,
                    after_commit=job.reached.set,
                )
                job.outcome = "committed" if path is not None else "off"
                job.ungated = bool(path is not None and job.watch_count and not job.gated)
            except SnapshotTorn:
                job.outcome = "torn"
            except BaseException as e:  # raised in the training's thread, at settle()
                job.error = e
            finally:
                if area is not None:
                    area.slots.gate = None
                job.payload = None
                job.copied.set()  # never reached the gate (failed first): nothing to wait for
                job.reached.set()
                job.done.set()

    def _torn(self, job: _Job) -> bool:
        """Whether the failed save failed because a copy was torn on any rank (collective)."""
        group = self.area.group if self.area is not None and self.area.layout else self.group
        return _dist.any_true(bool(job.changed), group, what="snapshot verdict")

    def committed(self) -> None:
        """Wait until the snapshot in flight is committed (or given up). Called at the start
        of every ``run.step()``, before the step is logged: a step the log shows is never more
        than one step past the newest snapshot."""
        job = self._job
        if job is None:
            return
        job.judge()
        t0 = time.perf_counter()
        job.reached.wait()
        job.waited += time.perf_counter() - t0

    def settle(self) -> bool:
        """Wait until the snapshot in flight is done; raise its error. Called before the next
        one is taken, before a save, and at close. Whether there was one."""
        job = self._job
        if job is None:
            return False
        job.judge()
        t0 = time.perf_counter()
        job.done.wait()
        self._job = None
        if self._watch is not None:
            self._watch.end()
        if len(self._costs) < KEPT:
            self._costs.append(job.cost + job.waited + time.perf_counter() - t0)
        if job.outcome == "committed":
            self.taken += 1
        elif job.outcome == "torn":
            new = sorted(set(job.changed) - self._sync)
            self._sync.update(job.changed)
            log.info(
                "unbroken: the in-memory snapshot of step %d was not kept: %s changed before "
                "the next optimizer step; copied at the step's end from now on",
                job.step,
                ", ".join(new[:5]) or "a tensor on another rank",
            )
        elif job.outcome == "off":
            self.area = None
        if job.ungated:
            # Not reachable through SnapshotArea.save (every data file goes through the slots);
            # should a path bypass them, nothing could judge its copies: the step's path then.
            log.warning("unbroken: in-memory snapshots are taken in the step's path from now on")
            self._background = False
        if job.error is not None:
            self._background = False  # the next ones in the step's path, as before
            raise job.error
        if self.interval is None and len(self._costs) >= MEASURED:
            self.interval = self._choose_interval()
        return True

    def close(self) -> None:
        """Commit the snapshot in flight; stop the thread and the hook."""
        try:
            self.settle()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
                BEFORE_UPDATE.remove(self._before_update)
            if self._watch is not None:
                self._watch.close()
            if self._thread is not None and self._queue is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None

    # ---- sizes and interval -----------------------------------------------------------------

    def _fits(self, payload: Any) -> bool:
        assert self.area is not None
        nbytes = sum(t.numel() * t.element_size() for t in payload.tensors.values())
        layout = self.area.layout
        if layout is None:
            ok = self.area.fits(nbytes) if self.rank == 0 else True
            ok = _dist.broadcast_object(ok)
        else:  # each node's own memory, for its ranks' part and the copy (about as large)
            ok = self.area.fits(2 * nbytes) if layout.leader else True
            ok = not _dist.any_true(not ok, what="snapshot memory")
        if not ok:
            if self.area.disabled is not None:
                log.warning("unbroken: %s", self.area.disabled)
            self.area = None
        return bool(ok)

    def _choose_interval(self) -> int:
        cost = statistics.median(self._costs[:MEASURED])
        step_s = self._step_s
        every = int(_dist.broadcast_object(interval_for(cost, step_s)))
        if self.rank == 0:
            _log.say(
                log,
                "in-memory snapshot every %d step(s): one costs the step %.2f ms, a step takes "
                "%.1f ms (at most %g%% of the step time; snapshot_every in Run to choose)",
                every,
                cost * 1e3,
                step_s * 1e3,
                BUDGET * 100,
            )
        return every

    def source_for(self, reader: CheckpointReader) -> Any:
        """The snapshot holding ``reader``'s very checkpoint, if this node has it: its tensors
        are read from memory instead of the disk."""
        if self.area is None:
            return reader
        snap = self.area.matching(reader)
        if snap is None:
            return reader
        log.info("unbroken: reading step %d from the in-memory snapshot", reader.step)
        return snap


_ATOMS = (str, int, float, bool, type(None))


def _copy_tree(tree: Any) -> Any:
    """A copy of a state's JSON tree as it is now: dicts, lists and tuples copied, numbers and
    strings shared (immutable), anything else deep-copied. ``copy.deepcopy`` of it all took
    0.6 ms of char_lm's step (its memo and dispatch per element)."""
    t = type(tree)
    if t in _ATOMS:
        return tree
    if t is dict:
        return {k: _copy_tree(v) for k, v in tree.items()}
    if t is list:
        return [v if type(v) in _ATOMS else _copy_tree(v) for v in tree]
    if t is tuple:
        return tuple(v if type(v) in _ATOMS else _copy_tree(v) for v in tree)
    return _copy.deepcopy(tree)


def _on_gpu(tensors: Iterable[torch.Tensor]) -> bool:
    return any(t.device.type != "cpu" for t in tensors)


def _ptr(t: torch.Tensor) -> int:
    try:
        return int(t.data_ptr())
    except RuntimeError:  # no storage (a meta tensor, a wrapper): copied at the step's end
        return 0
