"""The checkpoint store of one run directory: commit, scan, fall back, retain, clean up.

Commit protocol (every rank writes, rank 0 commits)::

    rank 0: mkdir checkpoints/.tmp-step-N                   (a stale one is removed first)
    all:    DCP tensor files + rank-RRRRR.json, each hashed while written, then fsynced
    rank 0: state.json, manifest.json (written last, fsynced), fsync .tmp dir
            rename .tmp-step-N -> step-N, fsync checkpoints/
    rank 0: retention (rename to .del-step-M, then delete)  -- only after the commit

A failure on any rank is agreed on by all ranks before the commit, so no rank commits alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    write_error,
)
from ..process import _log
from ..process._logfile import open_regular
from . import _fsops, _layout, _manifest
from ._entry import LOCAL, Entry
from ._reader import CheckpointReader

if TYPE_CHECKING:  # listing and finding checkpoints import no torch (`unbroken ls`)
    from ..state import Payload

log = _log.get("store")


RESCANS = 100
"""How often :meth:`CheckpointStore.latest` scans again when retention deleted what it read."""


@dataclass(frozen=True, slots=True)
class Retention:
    """Which committed checkpoints to keep; the newest one is always kept."""

    keep_last: int | None = 3
    """Keep the newest N (None keeps all)."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this."""

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1 or None, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"keep_every must be >= 1 or None, got {self.keep_every}")


@dataclass(frozen=True, slots=True)
class Listing:
    """One checkpoint of ``CheckpointStore.listing()``: step, path, validity and why, size,
    commit time, pinned."""

    step: int
    path: str
    valid: bool
    reason: str
    size: int
    mtime: float
    pinned: bool
    saved_at: float | None = None
    """When the checkpoint was committed (its manifest's ``saved_at_unix``); the directory's
    mtime changes when it is pinned."""


class CheckpointStore:
    """Checkpoints of one run directory. Every rank constructs one; rank 0 owns the directory."""

    def __init__(self, run_dir: str, retention: Retention | None = None) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.root = _layout.checkpoints_dir(self.run_dir)
        self.retention = retention or Retention()

    # ---- start-up -----------------------------------------------------------------------------

    def clean_stale(self) -> list[str]:
        """Remove what a killed save or deletion left behind (call while holding the lock)."""
        removed: list[str] = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return removed
        for e in entries:
            t = _layout.transient(e.name)
            if t is None:
                continue
            if not e.is_dir(follow_symlinks=False):
                # Not something a save of ours leaves (a symlink, a file): nothing of ours is in
                # it; the link itself is removed, never what it points to.
                try:
                    os.unlink(e.path)
                    removed.append(e.path)
                except OSError:
                    pass
                continue
            kind, step = t
            final = os.path.join(self.root, _layout.step_name(step))
            if kind == "old" and not os.path.exists(final):
                # Killed between moving the old copy of a step aside and renaming the new one in.
                os.rename(e.path, final)
                continue
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(e.path)
        return removed

    # ---- finding ------------------------------------------------------------------------------

    def listing(self, *, checksums: bool = True) -> list[Listing]:
        """Every checkpoint directory, newest first; one deleted while it is read (retention
        of a live run) is gone, not corrupt, and left out -- and when that leaves no valid
        one, the directory is scanned again (retention deletes only after a newer commit)."""
        for _ in range(RESCANS):
            out, vanished = self._listing(checksums)
            if not vanished or any(item.valid for item in out):
                break
        return out

    def _listing(self, checksums: bool) -> tuple[list[Listing], bool]:
        out, vanished = [], False
        for step, path in _layout.scan(self.run_dir):
            valid, reason, size, saved_at = True, "", 0, None
            try:
                r = CheckpointReader(path)
                saved_at = _number(r.manifest.get("saved_at_unix"))
                r.verify(checksums=checksums)
                size = r.size_bytes()
                mtime = os.stat(path).st_mtime
            except (CheckpointError, OSError) as e:
                if _vanished(path):
                    vanished = True
                    continue
                if not isinstance(e, CheckpointError):
                    raise
                valid, reason = False, str(e)
                mtime = _mtime(path)
            pinned = os.path.exists(os.path.join(path, _layout.PINNED))
            out.append(Listing(step, path, valid, reason, size, mtime, pinned, saved_at))
        return out, vanished

    def entries(self) -> list[Entry]:
        """Every checkpoint directory, newest first, not read yet (train/_choice.py)."""
        return [Entry(step, LOCAL, path) for step, path in _layout.scan(self.run_dir)]

    def verdict(self, entry: Entry, *, checksums: bool = True, data: bool = True) -> Entry | None:
        """``entry`` verified (see :meth:`latest` for ``data``); None when it is gone."""
        try:
            CheckpointReader(entry.where).verify(checksums=checksums, data=data)
        except (CheckpointError, OSError) as e:
            if _vanished(entry.where):
                return None
            if not isinstance(e, CheckpointError):
                raise
            return entry.unusable(str(e))
        return entry.verified()

    def latest(self, *, checksums: bool = True, data: bool = True) -> CheckpointReader | None:
        """The newest checkpoint that verifies; each unusable newer one is reported by name.
        ``data=False`` leaves the checksums of format-2 data files to the load, which verifies
        every chunk as it reads it (one pass; the caller falls back if the load fails).

        None only when there is no checkpoint directory at all. Checkpoints none of which
        loads raise CorruptCheckpointError listing each and why: a reader that cannot read a
        run's checkpoints must not let the run start over (and retention delete them).
        """
        failures: dict[str, str] = {}
        for _ in range(RESCANS):
            vanished = False
            for _, path in _layout.scan(self.run_dir):
                if path in failures:
                    continue
                try:
                    r = CheckpointReader(path)
                    r.verify(checksums=checksums, data=data)
                    return r
                except (CheckpointError, OSError) as e:
                    if _vanished(path):
                        vanished = True  # deleted by a live run's retention while we read it
                        continue
                    if not isinstance(e, CheckpointError):
                        raise
                    failures[path] = str(e)
                    _log.event(
                        log,
                        logging.WARNING,
                        "unbroken: skipping unusable checkpoint %s: %s; trying an earlier one",
                        path,
                        e,
                        path=path,
                    )
            if not vanished:
                break
            # Retention deletes a checkpoint only once a newer one committed: scan again.
        if not failures:
            return None
        listed = "\n".join(f"  {path}: {why}" for path, why in failures.items())
        raise CorruptCheckpointError(
            f"none of the {len(failures)} checkpoint(s) in {self.root} can be loaded, so the "
            f"run does not start over on top of them:\n{listed}\nRepair or move them away, "
            "or pass start_over=True to Run once to move them into "
            f"{os.path.join(self.root, 'abandoned-<time>')} (nothing is deleted) and start "
            "fresh.",
            path=self.root,
        )

    def open(self, step: int, *, checksums: bool = True, data: bool = True) -> CheckpointReader:
        path = os.path.join(self.root, _layout.step_name(step))
        if not os.path.isdir(path):
            have = [s for s, _ in _layout.scan(self.run_dir)]
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {self.root} (found steps {sorted(have)})",
                path=path,
                step=step,
            )
        r = CheckpointReader(path)
        r.verify(checksums=checksums, data=data)
        return r

    # ---- saving -------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        payload: Payload,
        meta: dict[str, Any],
        group: Any = None,
        before_commit: Callable[[], bool] | None = None,
    ) -> str:
        """Write and commit a checkpoint of ``step`` (collective over ``group``); returns its
        path. A background save passes its own process group, so that its collectives never
        interleave with the training's. ``before_commit`` (an in-memory snapshot taken in the
        background): called on every rank once every file is written, before the rename that
        commits; it raises to abort (on every rank, agreed), and returns True when its caller
        renamed the directory into place itself (:meth:`rename_into_place`, one process)."""
        from .. import _dist

        rank, world = _dist.rank(), _dist.world_size()
        tmp = os.path.join(self.root, _layout.tmp_name(step))
        final = os.path.join(self.root, _layout.step_name(step))
        err: BaseException | None = None
        if rank == 0:
            err = _attempt(lambda: self._prepare(tmp))
        self._agree(err, tmp, step, group)
        records: dict[str, tuple[int, str]] = {}
        err = _attempt(lambda: records.update(self._write_rank_files(tmp, payload, group)))
        self._agree(err, tmp, step, group)
        gathered = _dist.all_gather_object(records, group)
        if before_commit is None:
            if rank == 0:
                files = {k: v for part in gathered for k, v in part.items()}
                state, manifest = _manifest.build(step, payload, files, meta, world)
                err = _attempt(lambda: self._install(tmp, final, state, manifest))
            self._agree(err, tmp, step, group)
            return final
        if rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
            state, manifest = _manifest.build(step, payload, files, meta, world)
            err = _attempt(lambda: self._write_commit_files(tmp, state, manifest))
        renamed: list[bool] = []
        err = err or _attempt(lambda: renamed.append(before_commit()))
        self._agree(err, tmp, step, group)
        if rank == 0 and not (renamed and renamed[0]):
            err = _attempt(lambda: self.rename_into_place(step))
        self._agree(err, tmp, step, group)
        return final

    def _write_rank_files(self, tmp: str, payload: Payload, group: Any) -> dict[str, Any]:
        """This rank's tensor files and rank-RRRRR.json, fsynced; {file: (size, xxh3)}."""
        from .. import _dist
        from . import _storage

        records = dict(_storage.write_tensors(tmp, payload.tensors, group))
        name = _manifest.rank_file(_dist.rank())
        doc = {"components": payload.local_trees}
        records[name] = _fsops.write_file(os.path.join(tmp, name), _manifest.dumps(doc))
        for fname in sorted(records):
            _fsops.fsync_file(os.path.join(tmp, fname))
        return records

    def _prepare(self, tmp: str) -> None:
        os.makedirs(self.root, exist_ok=True)
        if os.path.lexists(tmp):
            _fsops.remove_tree(tmp)
            if os.path.lexists(tmp):
                shutil.rmtree(tmp)  # what could not be removed raises, naming its file
        _fsops.mkdir(tmp)

    def _install(
        self, tmp: str, final: str, state_doc: dict[str, Any], manifest: dict[str, Any]
    ) -> None:
        """state.json, then the manifest (last, fsynced), then the rename: the commit."""
        self._write_commit_files(tmp, state_doc, manifest)
        self._rename_into_place(tmp, final, int(manifest["step"]))

    def rename_into_place(self, step: int) -> None:
        """The commit of a checkpoint whose files are all written (see ``before_commit``)."""
        tmp = os.path.join(self.root, _layout.tmp_name(step))
        self._rename_into_place(tmp, os.path.join(self.root, _layout.step_name(step)), step)

    def _write_commit_files(
        self, tmp: str, state_doc: dict[str, Any], manifest: dict[str, Any]
    ) -> None:
        state = os.path.join(tmp, _manifest.STATE_FILE)
        size, digest = _fsops.write_file(state, _manifest.dumps(state_doc))
        listed = manifest["files"][_manifest.STATE_FILE]
        if (size, digest) != (listed["size"], listed["xxh3_64"]):
            raise CheckpointError(f"{state} does not match the manifest built for it")
        _fsops.fsync_file(state)
        path = os.path.join(tmp, _manifest.MANIFEST)
        _fsops.write_file(path, _manifest.dumps(manifest))
        _fsops.fsync_file(path)
        _fsops.fsync_dir(tmp)

    def _rename_into_place(self, tmp: str, final: str, step: int) -> None:
        old = None
        if os.path.lexists(final):
            # Re-saving a step (e.g. load, then save at once): keep the old copy until the
            # new one is in place; clean_stale() finishes the swap if we die in between.
            old = os.path.join(self.root, _layout.old_name(step))
            _fsops.rename(final, old)
        try:
            _fsops.rename(tmp, final)
            _fsops.fsync_dir(self.root)
        except BaseException:
            # Not committed (a failed fsync is not retried into a success): take the new copy
            # back to the temp name (the caller removes it) and put the replaced one back.
            if os.path.lexists(final) and not os.path.lexists(tmp):
                os.rename(final, tmp)
            if old is not None:
                os.rename(old, final)
            raise
        if old is not None:
            try:
                _fsops.rmtree(old)
            except OSError:
                pass  # committed already; clean_stale() removes the leftover copy

    def _agree(
        self,
        err: BaseException | None,
        tmp: str,
        step: int,
        group: Any = None,
        owner: bool | None = None,
    ) -> None:
        """Raise on every rank if the step failed on any; ``owner`` (default: rank 0) removes
        the temporary directory."""
        from .. import _dist

        failed = _dist.any_true(err is not None, group, what="commit verdict")
        if not failed:
            return
        if _dist.rank() == 0 if owner is None else owner:
            _fsops.remove_tree(tmp)
        if err is None:
            raise CheckpointWriteError(
                f"saving step {step} failed on another rank; nothing was committed", step=step
            )
        mapped = write_error(err, tmp, step, self.root)
        if mapped is err:
            raise err
        raise mapped from err

    # ---- retention ----------------------------------------------------------------------------

    def apply_retention(self, newest: int, protect: Iterable[int] = ()) -> list[int]:
        """Delete committed checkpoints older than ``newest`` that the policy does not keep."""
        r = self.retention
        older = [
            (s, p, _manifest.manifest_of(p)) for s, p in _layout.scan(self.run_dir) if s < newest
        ]
        manifests = {p: m for _, p, m in older if m is not None}  # None: not ours
        committed = [(s, p) for s, p, _ in older if p in manifests]
        keep = set(protect) | {newest}
        if r.keep_last is not None:
            # Newest first, keep_last - 1 checkpoints besides the new one -- counting only those
            # whose files are all there with their sizes (a stat each), so that a damaged
            # checkpoint never takes the place of the last intact one; it is kept meanwhile.
            intact = 0
            for s, p in committed:
                if intact >= r.keep_last - 1:
                    break
                keep.add(s)
                intact += _manifest.sizes_ok(p, manifests[p])
        else:
            keep |= {s for s, _ in committed}
        if r.keep_every:
            keep |= {s for s, _ in committed if s % r.keep_every == 0}
        keep |= {s for s, p in committed if os.path.exists(os.path.join(p, _layout.PINNED))}
        deleted = []
        for s, p in committed:
            if s in keep:
                continue
            doomed = os.path.join(self.root, _layout.del_name(s))
            try:
                _fsops.rename(p, doomed)
                _fsops.rmtree(doomed)
            except OSError as e:
                _log.event(
                    log,
                    logging.WARNING,
                    "unbroken: retention could not delete %s: %s",
                    p,
                    e,
                    step=s,
                    path=p,
                )
                continue
            deleted.append(s)
        return deleted

    def supersede_newer(self, step: int) -> list[str]:
        """Move checkpoints newer than ``step`` aside (resuming an older step forks history).
        Nothing is deleted, so neither a re-save of their step nor retention can destroy
        them."""
        moved = [self._aside(p, s, "superseded") for s, p in _layout.scan(self.run_dir) if s > step]
        if moved:
            _log.event(
                log,
                logging.WARNING,
                "unbroken: resumed from step %d and history forks there, so newer checkpoints "
                "were moved aside (not deleted): %s",
                step,
                moved,
                step=step,
            )
        return moved

    def set_aside(self, step: int, why: str) -> str | None:
        """Move the checkpoint of ``step`` aside as unusable (``why``: what failed), not
        deleted -- so that neither saving its step again nor retention destroys it; returns
        where it went (None: there is none)."""
        for s, p in _layout.scan(self.run_dir):
            if s == step:
                target = self._aside(p, s, "unusable")
                _log.event(
                    log,
                    logging.WARNING,
                    "unbroken: skipping unusable checkpoint %s: %s; moved aside (not deleted) "
                    "as %s",
                    p,
                    why,
                    target,
                    step=step,
                    path=target,
                )
                return target
        return None

    def _aside(self, path: str, step: int, prefix: str) -> str:
        target = os.path.join(self.root, f"{prefix}-{_layout.step_name(step)}-{int(time.time())}")
        os.rename(path, target)
        return target

    def abandon(self, extra: Iterable[str] = ()) -> str | None:
        """Move every checkpoint (and the files ``extra`` names, e.g. the metrics log) into
        ``checkpoints/abandoned-<UTC time>/``, deleting nothing; returns that directory, or
        None when there was nothing to move. Starting over is then a fresh start."""
        found = [p for _, p in _layout.scan(self.run_dir)]
        others = [p for p in extra if os.path.lexists(p)]
        if not found:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = os.path.join(self.root, f"abandoned-{stamp}")
        n = 0
        while os.path.lexists(target):
            n += 1
            target = os.path.join(self.root, f"abandoned-{stamp}-{n}")
        os.mkdir(target)
        for p in [*found, *others]:
            os.rename(p, os.path.join(target, os.path.basename(p)))
        _fsops.fsync_dir(target)
        _fsops.fsync_dir(self.root)
        _log.event(
            log,
            logging.WARNING,
            "unbroken: start_over: moved %d checkpoint(s) into %s (nothing deleted); "
            "starting fresh",
            len(found),
            target,
            path=target,
        )
        return target

    def pin(self, step: int, pinned: bool = True) -> None:
        path = os.path.join(self.root, _layout.step_name(step), _layout.PINNED)
        if not os.path.isdir(os.path.dirname(path)):
            steps = [s for s, _ in _layout.scan(self.run_dir)]
            there = ", ".join(map(str, sorted(steps))) if steps else "none"
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {self.root}; the steps it holds: {there}",
                path=os.path.dirname(path),
                step=step,
            )
        if pinned:
            # Not through a symlink planted there (it would create or touch its target).
            os.close(open_regular(path, os.O_WRONLY | os.O_CREAT, "pin marker"))
        elif os.path.lexists(path):
            os.remove(path)


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and value == value else None


def _vanished(path: str) -> bool:
    return not os.path.lexists(path)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _attempt(fn: Any) -> BaseException | None:
    """Run one phase of a save; its error is agreed on by all ranks before anyone raises."""
    try:
        fn()
    except Exception as e:
        return e
    return None
