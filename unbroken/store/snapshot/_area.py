"""In-memory snapshots: lose at most one step to a crash.

Under ``unbroken run`` the supervisor gives the trainer a private area in shared memory
(``/dev/shm/unbroken-<uid>/sup-...``, see unbroken/process/_shm.py for who may touch it) through
:data:`ENV`. The trainer commits a snapshot there every ``snapshot_every`` steps -- a complete
checkpoint, committed by the same store and commit protocol as a durable one (temporary name,
manifest last, rename), so a snapshot is never torn: a kill during one leaves the previous one.
Its tensor bytes go into one of two fixed slots per rank, allocated in full once and
overwritten in place (store/snapshot/_slots.py: never the slot the newest snapshot links), so a
snapshot costs about one ``copy_`` of the state and a hash: no disk, no fsync reaching a disk,
no fresh tmpfs pages -- and no write can meet a full ``/dev/shm`` halfway (SIGBUS). When memory
runs out anyway (allocating a slot, writing the JSON), snapshots are off for the rest of the
process with a warning, and durable saves go on.

When the trainer dies without a clean exit, the supervisor (:func:`persist_own`) commits the
newest snapshot that verifies into the run directory the trainer told it through the area's
channel (never one a snapshot names) through the durable commit protocol -- its files copied,
the copy verified (checksums, table), fsynced, renamed into place -- unless a durable checkpoint
of that step or a later one exists, and relaunches; the relaunch resumes from it like from any
checkpoint. A relaunch on the same node reads the tensors of the checkpoint it resumes from the
snapshot area when the very same snapshot is there (same manifest checksum), instead of the disk.

What survives what: a crash, kill -9 or OOM kill of the trainer -> the snapshot (at most
``snapshot_every - 1`` steps lost); the node -> only durable checkpoints.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable
from typing import Any

from ...errors import CheckpointError, CheckpointWriteError, LockError
from ...process import _log, _shm
from ...process._logfile import METRICS_FILE
from ...process._shm import ENV as ENV
from ...process._shm import SHM
from .. import _fsops, _layout, _manifest, _storage
from .._entry import SNAPSHOT, Entry
from .._lock import WriterLock
from .._reader import CheckpointReader
from .._safeio import safe_file, safe_name
from .._store import CheckpointStore, Retention
from ._nodes import NodeLayout, save_part
from ._slots import Slots

log = _log.get()


class SnapshotsOff(Exception):
    """In-memory snapshots cannot be used here; the message says why (durable saves go on)."""


class SnapshotTorn(Exception):
    """A snapshot taken in the background was not committed: a tensor it copied changed
    before the copy was complete (the previous snapshot stays the newest)."""


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class SnapshotArea:
    """The trainer's side: commit a snapshot of a payload; keep only the newest. Raises
    SnapshotsOff when ``root`` is not this user's private area (another user's directory, a
    link, one others can write in)."""

    def __init__(self, root: str, clean: bool = True) -> None:
        self.root = root
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError as e:
            raise SnapshotsOff(f"cannot create snapshot area {root}: {e.strerror}") from None
        why = _shm.check_private(root)
        if why is not None:
            raise SnapshotsOff(why)
        # keep_last=1: the new snapshot commits before the previous one is deleted, so the area
        # holds at most two (the double buffer) and always one complete one.
        self.store = CheckpointStore(root, Retention(keep_last=1))
        if clean:  # rank 0 only: a killed snapshot's leftovers
            self.store.clean_stale()
        self.slots = Slots(root)
        self.disabled: str | None = None
        self._told: str | None = None
        # A job over several nodes: this node's part of each snapshot (store/snapshot/_nodes.py).
        self.layout: NodeLayout | None = None
        self.group: Any = None

    def across_nodes(self, layout: NodeLayout, group: Any) -> None:
        """Commit this node's part of each snapshot, with a copy of the previous node's
        (``group``: a gloo group of every rank, for the copies)."""
        self.layout, self.group = layout, group

    def _leader(self) -> bool:
        """The rank that commits in this area: rank 0, or each node's first rank."""
        return self.layout.leader if self.layout is not None else _is_rank0()

    def fits(self, nbytes: int) -> bool:
        """Whether two snapshots of ``nbytes`` fit (the new one beside the previous one)."""
        have = free_bytes(self.root) + self._used()
        if have >= 2 * nbytes + nbytes // 8 + (64 << 10):  # two, and room for the JSON
            return True
        self.disabled = (
            f"shared memory at {self.root} has {have >> 20} MiB for snapshots, "
            f"{(2 * nbytes) >> 20} MiB are needed (two of the state); in-memory snapshots are "
            "off, durable saves only (enlarge /dev/shm, e.g. docker --shm-size)"
        )
        return False

    def _used(self) -> int:
        return self.slots.used_bytes()

    def tell(self, run_dir: str) -> None:
        """Tell the supervisor the run directory (rank 0, once per directory): the only one
        it persists snapshots into, and where it looks for durable progress after a crash."""
        if self._leader() and run_dir != self._told:
            _shm.tell_run_dir(self.root, run_dir)
            self._told = run_dir

    def save(
        self,
        step: int,
        payload: Any,
        meta: dict[str, Any],
        group: Any = None,
        torn: Callable[[], bool] | None = None,
        before_commit: Callable[[], bool] | None = None,
        after_commit: Callable[[], None] | None = None,
    ) -> str | None:
        """Commit a snapshot of ``step``; its path, or None when it could not be written (a full
        ``/dev/shm``, say): :attr:`disabled` then says why, on every rank (the store agrees on
        failures), and snapshots are off. ``torn`` (a snapshot taken in the background): asked,
        on every rank, when the save failed -- True when it failed because a tensor changed
        under the copy on some rank; then :class:`SnapshotTorn` is raised and snapshots stay
        on (the previous snapshot is still the newest). ``before_commit``: see
        CheckpointStore.save; ``after_commit``: called once it is committed, before the
        previous snapshot is deleted."""
        if self.disabled is not None:
            return None
        run_dir = meta.get("run_dir")
        if isinstance(run_dir, str):
            self.tell(run_dir)  # before the snapshot: a supervisor persists only into it
        try:
            with _storage.data_files_into(self.slots):
                if self.layout is not None:
                    path = save_part(
                        self.store, step, payload, meta, self.layout, self.group, before_commit
                    )
                else:
                    path = self.store.save(step, payload, meta, group, before_commit)
        except BaseException as e:
            self.slots.aborted()  # not committed: the previous snapshot's slot stays in use
            if torn is not None and isinstance(e, Exception) and torn():
                raise SnapshotTorn(step) from e
            if isinstance(e, CheckpointWriteError):
                self._turn_off(step, e)
                return None
            raise
        self.slots.committed()
        if after_commit is not None:
            after_commit()  # committed: what follows is housekeeping
        if self._leader():
            self.store.apply_retention(step)
            self._drop_newer(step)
        return path

    def _turn_off(self, step: int, e: CheckpointWriteError) -> None:
        self.disabled = (
            f"the in-memory snapshot of step {step} could not be written ({e}); in-memory "
            "snapshots are off for the rest of this run, durable saves go on (enlarge /dev/shm, "
            "e.g. docker --shm-size, or free it)"
        )
        log.warning("unbroken: %s", self.disabled)
        # Give the memory back: the slot not linked by the previous snapshot (still a complete
        # one, which the supervisor persists if it is newer than the durable checkpoints).
        self.slots.release_unused()

    def _drop_newer(self, step: int) -> None:
        """Snapshots newer than the one just taken belong to a history the trainer left (it
        resumed an earlier step): persisting one after a crash would resurrect it."""
        for s, p in _layout.scan(self.root):
            if s > step:
                doomed = os.path.join(self.store.root, _layout.del_name(s))
                _fsops.rename(p, doomed)
                _fsops.rmtree(doomed)

    def close(self) -> None:
        """Unmap the slots (the files stay: the supervisor persists or removes them)."""
        self.slots.close()

    def entries(self) -> list[Entry]:
        """The snapshots in the area, newest first, not read yet (train/_choice.py)."""
        return [Entry(step, SNAPSHOT, path) for step, path in _layout.scan(self.root)]

    def verdict(self, entry: Entry, run_dir: str) -> Entry:
        """``entry`` verified from its metadata (the JSON files' checksums, the data files'
        sizes), as a snapshot of ``run_dir`` that this area holds whole."""
        try:
            snap = CheckpointReader(entry.where)
            _check_run_dir(snap, run_dir)
            if not all(_is_file(snap.path, name) for name in snap.manifest["files"]):
                return entry.unusable(
                    "this node's area holds only its part of it (a job over several nodes)"
                )
            snap.verify(checksums=True, data=False)
        except (CheckpointError, OSError) as e:
            return entry.unusable(str(e))
        return entry.verified()

    def keep(self, step: int, run_dir: str) -> str:
        """Commit snapshot ``step`` into ``run_dir`` as the supervisor would have after the
        trainer's death (:func:`persist`), by the caller that holds the run directory's lock:
        copied, the copy verified (every checksum), fsynced, renamed into place. Returns the
        committed path; raises CheckpointError when the copy does not verify."""
        snap = CheckpointReader(os.path.join(self.store.root, _layout.step_name(step)))
        _check_run_dir(snap, run_dir)
        path = _commit_copy(snap, run_dir)
        metrics = os.path.join(run_dir, METRICS_FILE)
        if os.path.isfile(metrics) and not os.path.islink(metrics):
            _fsops.fsync_file(metrics)  # the log the snapshot records must survive with it
        return path

    def matching(self, reader: CheckpointReader) -> CheckpointReader | None:
        """The snapshot that is ``reader``'s checkpoint (same manifest), if the area holds it."""
        path = os.path.join(self.store.root, _layout.step_name(reader.step))
        try:
            snap = CheckpointReader(path)
            if snap.manifest.get(_manifest.SELF_CHECKSUM) != reader.manifest.get(
                _manifest.SELF_CHECKSUM
            ):
                return None
            snap.verify(checksums=True, data=False)
            return snap
        except (CheckpointError, OSError):
            return None


def _is_rank0() -> bool:
    from ... import _dist

    return _dist.rank() == 0


def persist(area: str, run_dir: str, wait: float = 0.0) -> int | None:
    """Commit the newest snapshot of ``area`` that verifies into ``run_dir`` if it is newer
    than every durable checkpoint there; returns its step, or None when there was nothing newer
    to keep. ``run_dir`` comes from the caller (the supervisor's channel), never from the area:
    a snapshot that names another run directory is refused. ``wait``: seconds to wait for the
    run directory's lock when another process holds it (in a job over several nodes, the
    supervisors of the surviving nodes persist their parts of one snapshot at once)."""
    if not os.path.isdir(area):
        return None
    os.makedirs(run_dir, exist_ok=True)
    durable = [s for s, _ in _layout.scan(run_dir)]
    newest = max(durable, default=-1)
    candidates = [(s, p) for s, p in _layout.scan(area) if s > newest]
    if not candidates:
        return None
    lock = WriterLock(run_dir)
    _acquire(lock, area, wait)
    try:
        step = _persist_newest(candidates, run_dir)
    finally:
        lock.release()
    if step is None:
        return None
    metrics = os.path.join(run_dir, METRICS_FILE)
    if os.path.isfile(metrics) and not os.path.islink(metrics):
        _fsops.fsync_file(metrics)  # the log the snapshot records must survive with it
    log.info(  # the supervisor, which called this, tells the user (once)
        "unbroken: the trainer died; kept its in-memory snapshot of step %d in %s", step, run_dir
    )
    return step


def _acquire(lock: WriterLock, area: str, wait: float) -> None:
    deadline = time.monotonic() + wait
    while True:
        try:
            lock.acquire()
            return
        except LockError as e:
            if time.monotonic() >= deadline:
                log.warning("unbroken: cannot persist the in-memory snapshot of %s: %s", area, e)
                raise
        time.sleep(0.05)


def _persist_newest(candidates: list[tuple[int, str]], run_dir: str) -> int | None:
    """Commit the newest candidate whose copy verifies; the others are reported and skipped. A
    node's part of a snapshot (store/snapshot/_nodes.py) is added to the merge of that snapshot in
    the run directory, committed by whichever supervisor completes it."""
    for step, path in candidates:
        try:
            snap = CheckpointReader(path)
            _check_run_dir(snap, run_dir)
            if all(_is_file(snap.path, name) for name in snap.manifest["files"]):
                _commit_copy(snap, run_dir)
                return step
            if _merge_part(snap, run_dir):
                return step
            log.info(
                "unbroken: copied this node's part of the snapshot of step %d into %s; the "
                "other nodes' supervisors add theirs",
                step,
                run_dir,
            )
        except CheckpointError as e:
            log.warning("unbroken: in-memory snapshot %s not persisted: %s", path, e)
    return None


def _check_run_dir(snap: CheckpointReader, run_dir: str) -> None:
    named = snap.meta.get("run_dir")
    if named is not None and os.path.abspath(str(named)) != os.path.abspath(run_dir):
        raise CheckpointError(
            f"it is a snapshot of {named!r}, not of {run_dir}; not persisted there"
        )


def _is_file(directory: str, name: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(safe_name(directory, name)).st_mode)
    except OSError:
        return False


def _merge_part(snap: CheckpointReader, run_dir: str) -> bool:
    """Copy the files of a node's part of a snapshot that the merge in ``run_dir`` lacks
    (each whole or not at all: fsynced, then renamed into place); when that completes the file
    set, verify every checksum and commit it. Whether the snapshot is committed now."""
    root = _layout.checkpoints_dir(run_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, _layout.step_name(snap.step))
    if os.path.lexists(final):
        return True  # another node's supervisor completed it first
    own = str(snap.manifest[_manifest.SELF_CHECKSUM])
    merge = os.path.join(root, _layout.part_name(snap.step, own))
    os.makedirs(merge, mode=0o700, exist_ok=True)
    names = sorted(snap.manifest["files"])
    for name in names:
        dst = safe_name(merge, name)
        if os.path.lexists(dst) or not _is_file(snap.path, name):
            continue
        incoming = f"{dst}.incoming"
        shutil.copyfile(safe_file(snap.path, name), incoming, follow_symlinks=False)
        _fsops.fsync_file(incoming)
        _fsops.rename(incoming, dst)
    if not all(_is_file(merge, name) for name in names):
        return False
    try:
        dst = os.path.join(merge, _manifest.MANIFEST)
        shutil.copyfile(safe_file(snap.path, _manifest.MANIFEST), dst, follow_symlinks=False)
        _fsops.fsync_file(dst)
        copy = CheckpointReader(merge)
        if copy.manifest.get(_manifest.SELF_CHECKSUM) != own:
            raise CheckpointError(f"{snap.path} changed while it was copied")
        copy.verify(checksums=True)  # every node's files, against the one manifest
        _fsops.fsync_dir(merge)
        _fsops.rename(merge, final)
        _fsops.fsync_dir(root)
    except BaseException:
        shutil.rmtree(merge, ignore_errors=True)  # a bad copy must not complete a later merge
        raise
    drop_older_parts(root, snap.step)
    return True


def drop_older_parts(root: str, step: int) -> list[str]:
    """Once the snapshot of ``step`` is committed, remove the merges of older snapshots (and of
    another snapshot of the same step) in ``root``: a supervisor whose newest part did not
    complete a merge adds its older parts too (one of them might), and nothing resumes from an
    older step than a committed one. A newer merge may still complete: it stays."""
    removed = []
    for name in os.listdir(root):
        t = _layout.transient(name)
        if t is not None and t[0] == "part" and t[1] <= step:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def _commit_copy(snap: CheckpointReader, run_dir: str) -> str:
    """The durable commit protocol for files that already exist: copy, verify the copy (every
    checksum, the table, the file set), fsync, rename; returns the committed path."""
    root = _layout.checkpoints_dir(run_dir)
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, _layout.tmp_name(snap.step))
    final = os.path.join(root, _layout.step_name(snap.step))
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    _fsops.mkdir(tmp)
    try:
        names = sorted(snap.manifest["files"]) + [_manifest.MANIFEST]  # the manifest last
        for name in names:
            dst = os.path.join(tmp, name)
            src = safe_file(snap.path, name)  # a plain file: no link, no FIFO
            shutil.copyfile(src, dst, follow_symlinks=False)
            _fsops.fsync_file(dst)
        copy = CheckpointReader(tmp)
        if copy.manifest.get(_manifest.SELF_CHECKSUM) != snap.manifest.get(_manifest.SELF_CHECKSUM):
            raise CheckpointError(f"{snap.path} changed while it was copied")
        copy.verify(checksums=True)  # what is committed is what verifies, not what did before
        _fsops.fsync_dir(tmp)
        _fsops.rename(tmp, final)
        _fsops.fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ---- the supervisor's side ----------------------------------------------------------------------


def persist_own(area: _shm.SupervisorArea) -> tuple[int, str] | None:
    """After its trainer died: persist the newest snapshot of the supervisor's own area into
    the run directory its trainer told (see :func:`persist`); returns (step, run_dir) or None.
    Raises _shm.Refused when the area is no longer the one this supervisor created."""
    area.check()
    run_dir = area.run_dir()
    if run_dir is None:
        return None  # no snapshot was taken (the run directory is told before the first)
    step = persist(area.path, run_dir)
    return None if step is None else (step, run_dir)


def reap_stale(base: str = SHM) -> list[tuple[int, str]]:
    """Areas of this user's supervisors that died (kill -9): persist the newest snapshot of
    each into the run directory its channel names, if newer than the durable checkpoints, then
    remove it. An area whose run directory is locked by a live trainer (an orphan of that
    supervisor, still saving) is left for later."""
    kept = []
    for area in _shm.stale_areas(base):
        run_dir = area.run_dir()
        try:
            step = persist(area.path, run_dir) if run_dir is not None else None
        except LockError:
            area.release()
            continue
        except (CheckpointError, OSError) as e:
            log.warning("unbroken: could not persist stale snapshot area %s: %s", area.path, e)
            step = None
        if step is not None and run_dir is not None:
            kept.append((step, run_dir))
        area.discard()
    return kept
