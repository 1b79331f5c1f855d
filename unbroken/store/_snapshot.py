"""In-memory snapshots: lose at most one step to a crash.

Under ``unbroken run`` the supervisor gives the trainer a directory in shared memory
(``/dev/shm``) through :data:`ENV`. The trainer commits a snapshot there every
``snapshot_every`` steps -- a complete checkpoint, committed by the same store and commit
protocol as a durable one (temporary name, manifest last, rename), so a snapshot is never torn:
a kill during one leaves the previous one. Its tensor bytes go into one of two fixed slots per
rank, preallocated once and overwritten in place (store/_slots.py: never the slot the newest
snapshot links), so a snapshot costs about one ``copy_`` of the state and a hash: no disk, no
fsync reaching a disk, no fresh tmpfs pages.

When the trainer dies without a clean exit, the supervisor (:func:`persist`) commits the newest
snapshot that verifies into the run directory through the durable commit protocol (its files
copied, fsynced, renamed into place) -- unless a durable checkpoint of that step or a later one
exists -- and relaunches; the relaunch resumes from it like from any checkpoint. A relaunch on
the same node reads the tensors of the checkpoint it resumes from the snapshot area when the
very same snapshot is there (same manifest checksum), instead of the disk.

What survives what: a crash, kill -9 or OOM kill of the trainer -> the snapshot (at most
``snapshot_every - 1`` steps lost); the node -> only durable checkpoints.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

from .._errors import CheckpointError, LockError
from .._logfile import METRICS_FILE
from .._shm import ENV as ENV
from .._shm import SHM, discard, stale_areas
from .._shm import supervisor_area as supervisor_area
from . import _fsops, _layout, _manifest, _storage
from ._lock import WriterLock
from ._reader import CheckpointReader
from ._slots import Slots
from ._store import CheckpointStore, Retention

log = logging.getLogger("unbroken")


def area_for(run_dir: str, base: str = SHM) -> str:
    """The snapshot directory of ``run_dir`` on this node (one per run directory and user)."""
    key = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return os.path.join(base, f"unbroken-{os.getuid()}-{key}")


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class SnapshotArea:
    """The trainer's side: commit a snapshot of a payload; keep only the newest."""

    def __init__(self, root: str, clean: bool = True) -> None:
        self.root = root
        os.makedirs(root, mode=0o700, exist_ok=True)
        # keep_last=1: the new snapshot commits before the previous one is deleted, so the area
        # holds at most two (the double buffer) and always one complete one.
        self.store = CheckpointStore(root, Retention(keep_last=1))
        if clean:  # rank 0 only: a killed snapshot's leftovers
            self.store.clean_stale()
        self.slots = Slots(root)
        self.disabled: str | None = None

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

    def save(self, step: int, payload: Any, meta: dict[str, Any], group: Any = None) -> str:
        try:
            with _storage.data_files_into(self.slots):
                path = self.store.save(step, payload, meta, group=group)
        except BaseException:
            self.slots.aborted()  # not committed: the previous snapshot's slot stays in use
            raise
        self.slots.committed()
        if _is_rank0():
            self.store.apply_retention(step)
            self._drop_newer(step)
        return path

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
    from .. import _dist

    return _dist.rank() == 0


def persist(area: str, run_dir: str) -> int | None:
    """Commit the newest snapshot of ``area`` into ``run_dir`` if it is newer than every durable
    checkpoint there; returns its step, or None when there was nothing newer to keep."""
    if not os.path.isdir(area):
        return None
    snaps = CheckpointStore(area)
    try:
        snap = snaps.latest(checksums=True)
    except CheckpointError as e:
        log.warning("unbroken: no usable in-memory snapshot in %s: %s", area, e)
        return None
    if snap is None:
        return None
    durable = [s for s, _ in _layout.scan(run_dir)]
    if durable and max(durable) >= snap.step:
        return None
    os.makedirs(run_dir, exist_ok=True)
    lock = WriterLock(run_dir)
    try:
        lock.acquire()
    except LockError as e:
        log.warning("unbroken: cannot persist the snapshot of step %d: %s", snap.step, e)
        return None
    try:
        _commit_copy(snap, run_dir)
    finally:
        lock.release()
    metrics = os.path.join(run_dir, METRICS_FILE)
    if os.path.isfile(metrics) and not os.path.islink(metrics):
        _fsops.fsync_file(metrics)  # the log the snapshot records must survive with it
    log.info(  # the supervisor, which called this, tells the user (once)
        "unbroken: the trainer died; kept its in-memory snapshot of step %d in %s",
        snap.step,
        run_dir,
    )
    return snap.step


def _commit_copy(snap: CheckpointReader, run_dir: str) -> None:
    """The durable commit protocol for files that already exist: copy, fsync, rename."""
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
            shutil.copyfile(os.path.join(snap.path, name), dst, follow_symlinks=False)
            _fsops.fsync_file(dst)
        _fsops.fsync_dir(tmp)
        _fsops.rename(tmp, final)
        _fsops.fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- the supervisor's side ----------------------------------------------------------------------


def persist_area(area: str) -> tuple[int, str] | None:
    """Persist the newest snapshot of a supervisor's area into the run directory the trainer
    recorded in it (``meta["run_dir"]``); returns (step, run_dir) or None."""
    if not os.path.isdir(area):
        return None
    steps = _layout.scan(area)
    if not steps:
        return None
    try:
        run_dir = CheckpointReader(steps[0][1]).meta.get("run_dir")
    except CheckpointError:
        run_dir = None
    if not isinstance(run_dir, str) or not os.path.isabs(run_dir):
        # Only a trainer that recorded its run directory is persisted (an older one did not).
        log.warning("unbroken: snapshot area %s names no run directory; not persisted", area)
        return None
    step = persist(area, run_dir)
    return None if step is None else (step, run_dir)


def reap_stale(base: str = SHM) -> list[tuple[int, str]]:
    """Areas left by supervisors that died (kill -9, say): persist their newest snapshot if it
    is newer than the durable checkpoints, then remove them."""
    kept = []
    for area in stale_areas(base):
        try:
            got = persist_area(area)
        except (CheckpointError, OSError) as e:
            log.warning("unbroken: could not persist stale snapshot area %s: %s", area, e)
            continue
        if got is not None:
            kept.append(got)
        discard(area)
    return kept
