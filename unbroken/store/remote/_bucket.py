"""Checkpoints in an object store: the remote tier, committed by its manifest.

Layout under ``s3://bucket/prefix`` (the same names as a run directory)::

    checkpoints/step-000000100/tensors-r00000.bin, tensors.json, state.json, rank-00000.json
    checkpoints/step-000000100/metrics.jsonl   the run's metrics log up to this checkpoint
    checkpoints/step-000000100/manifest.json   uploaded LAST: the commit

An object store has no rename, so the manifest is the commit point: it is uploaded only after
every other object of the checkpoint is stored, and it lists each of them -- the metrics log
too -- with its size and xxh3 (the local manifest plus that one entry, its self-checksum
recomputed). A checkpoint exists remotely only when its manifest is there and verifies (schema,
self-checksum, every listed object present with its listed size); an upload killed at any
moment leaves objects without a manifest, which no listing, resume or tool ever takes for a
checkpoint, and which retention removes once a newer checkpoint is complete.

Retention deletes a checkpoint's manifest first, then its objects (a kill in between leaves an
uncommitted folder, swept later); it never deletes the newest complete checkpoint, and runs
only after a new one committed. One run writes one prefix (the local writer lock does not
reach across machines).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import xxhash

from ...errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RemoteStoreError,
    UnsafeCheckpointError,
)
from ...process import _log
from ...process._logfile import METRICS_FILE
from .. import _fsops, _layout, _manifest
from .._entry import REMOTE, Entry
from .._reader import CheckpointReader
from .._store import Listing, Retention, _number
from . import _fetch, _s3
from ._object_reader import RemoteReader

log = _log.get("store")
Scan = dict[int, dict[str, tuple[int, float]]]
UNUSABLE = (CorruptCheckpointError, UnsafeCheckpointError)
"""What makes a remote checkpoint unusable (skipped, reported); a RemoteStoreError (the store
cannot be read) is never taken for one."""


class RemoteStore:
    """The checkpoints under one ``s3://bucket/prefix`` URL."""

    def __init__(self, url: str, retention: Retention | None = None) -> None:
        self.objects = _s3.S3Objects(url)
        self.url = self.objects.url
        self.root = self.objects.where(_layout.CHECKPOINTS)
        self.retention = retention or Retention()

    def check(self) -> None:
        """Raise RemoteStoreError (naming bucket, endpoint and cause) unless reachable."""
        self.objects.check()

    # ---- finding ------------------------------------------------------------------------------

    def scan(self) -> Scan:
        """{step: {file name: (size, mtime)}} of every checkpoint folder, complete or not."""
        out: Scan = {}
        for name, rec in self.objects.list_under(_layout.CHECKPOINTS + "/").items():
            folder, _, file = name[len(_layout.CHECKPOINTS) + 1 :].partition("/")
            step = _layout.parse_step(folder)
            if step is not None and file and "/" not in file:
                out.setdefault(step, {})[file] = rec
        return out

    def _folder(self, step: int) -> str:
        return f"{_layout.CHECKPOINTS}/{_layout.step_name(step)}"

    def scan_step(self, step: int) -> dict[str, tuple[int, float]]:
        """{file name: (size, mtime)} of one checkpoint folder."""
        folder = self._folder(step) + "/"
        listed = self.objects.list_under(folder).items()
        return {n[len(folder) :]: r for n, r in listed if "/" not in n[len(folder) :]}

    def reader(self, step: int, files: dict[str, tuple[int, float]]) -> RemoteReader:
        sizes = {n: size for n, (size, _) in files.items()}
        return RemoteReader(self.objects, self._folder(step), sizes)

    def committed(self, scan: Scan | None = None) -> list[int]:
        """Steps whose folder holds a manifest (complete or corrupt), newest first."""
        scan = self.scan() if scan is None else scan
        return sorted((s for s, f in scan.items() if _manifest.MANIFEST in f), reverse=True)

    def listing(self, *, checksums: bool = True) -> list[Listing]:
        """Every checkpoint (a folder with a manifest), newest first, verified."""
        scan = self.scan()
        out = []
        for step in self.committed(scan):
            files = scan[step]
            valid, reason, saved_at = True, "", None
            try:
                r = self.reader(step, files)
                saved_at = _number(r.manifest.get("saved_at_unix"))  # the manifest parsed
                r.verify(checksums=checksums)
            except RemoteStoreError:
                raise
            except CheckpointError as e:
                valid, reason = False, str(e)
            # What the folder holds in the store, as a local listing sums the files on disk
            # (a corrupt checkpoint's objects too).
            size = sum(size for size, _ in files.values())
            mtime = files[_manifest.MANIFEST][1]
            where = self.objects.where(self._folder(step))
            out.append(Listing(step, where, valid, reason, size, mtime, False, saved_at))
        return out

    def entries(self) -> list[Entry]:
        """Every checkpoint (a folder with a manifest), newest first, not read yet
        (train/_choice.py)."""
        return [Entry(s, REMOTE, self.objects.where(self._folder(s))) for s in self.committed()]

    def verdict(self, entry: Entry, *, checksums: bool = False) -> Entry:
        """``entry`` verified: its manifest and sizes (with ``checksums``, every byte too)."""
        try:
            self.reader(entry.step, self.scan_step(entry.step)).verify(checksums=checksums)
        except RemoteStoreError:
            raise
        except CheckpointError as e:
            return entry.unusable(str(e))
        return entry.verified()

    def latest(self, *, checksums: bool = False) -> RemoteReader | None:
        """The newest checkpoint whose manifest and sizes verify (with ``checksums``, every
        byte too). None when there is none at all; checkpoints none of which verifies raise
        CorruptCheckpointError: never a fresh start over them."""
        scan = self.scan()
        failures = []
        for step in self.committed(scan):
            try:
                r = self.reader(step, scan[step])
                r.verify(checksums=checksums)
                return r
            except UNUSABLE as e:
                failures.append(f"  {self.objects.where(self._folder(step))}: {e}")
                _log.event(
                    log,
                    logging.WARNING,
                    "unbroken: skipping unusable remote checkpoint of step %d: %s",
                    step,
                    e,
                    step=step,
                )
        if not failures:
            return None
        listed = "\n".join(failures)
        raise CorruptCheckpointError(
            f"none of the {len(failures)} checkpoint(s) in {self.root} can be loaded, so the "
            f"run does not start over on top of them:\n{listed}\nRepair or remove them, or "
            "point remote= at another prefix.",
            path=self.root,
        )

    def open(self, step: int, *, checksums: bool = False) -> RemoteReader:
        scan = self.scan()
        if _manifest.MANIFEST not in scan.get(step, {}):
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {self.root} (found steps "
                f"{sorted(self.committed(scan))})",
                path=self.root,
                step=step,
            )
        r = self.reader(step, scan[step])
        r.verify(checksums=checksums)
        return r

    # ---- uploading ----------------------------------------------------------------------------

    def upload(self, local: str, metrics_log: str | None = None) -> bool:
        """Upload the committed local checkpoint ``local`` (with the first
        ``meta["metrics_bytes"]`` bytes of ``metrics_log``), manifest last. False when a
        complete copy of that step is there already (the same step of one history holds the
        same state), True when uploaded."""
        reader = CheckpointReader(local)
        reader.verify(checksums=False)  # every file there with its size; the table parses
        if reader.format_version != _manifest.FORMAT_VERSION:
            raise CorruptCheckpointError(f"{local} is format {reader.format_version}; not uploaded")
        step, folder = reader.step, self._folder(reader.step)
        existing: dict[str, tuple[int, float]] = {}
        if self.objects.size(f"{folder}/{_manifest.MANIFEST}") is not None:
            existing = self.scan_step(step)
            try:
                self.reader(step, existing).verify(checksums=False)
                return False
            except UNUSABLE:
                # Not a checkpoint (a damaged manifest): take its commit away before writing.
                self.objects.delete([f"{folder}/{_manifest.MANIFEST}"])
        manifest = dict(reader.manifest)
        files = dict(manifest["files"])
        items = [(f"{folder}/{n}", os.path.join(local, n), files[n]["size"]) for n in sorted(files)]

        if metrics_log is not None and METRICS_FILE not in files:
            n = _metrics_bytes(reader.meta, metrics_log)
            if n is not None:
                files[METRICS_FILE] = {"size": n, "xxh3_64": _hash_prefix(metrics_log, n)}
                items.append((f"{folder}/{METRICS_FILE}", metrics_log, n))
        manifest["files"] = dict(sorted(files.items()))
        manifest[_manifest.SELF_CHECKSUM] = _manifest.self_checksum(manifest)
        for key, _, _ in items:
            _fsops.event("upload", key)
        self.objects.upload(items)
        _fsops.event("upload-commit", folder)
        self.objects.put_bytes(f"{folder}/{_manifest.MANIFEST}", _manifest.dumps(manifest))
        return True

    # ---- downloading --------------------------------------------------------------------------

    def fetch(self, step: int, run_dir: str) -> str:
        """Download checkpoint ``step`` into ``run_dir`` through the local commit protocol
        (temporary folder, every byte verified as it lands, renamed into place) and install
        its metrics log as ``RUN/metrics.jsonl``; returns the committed local path."""
        remote = self.open(step)
        root = _layout.checkpoints_dir(run_dir)
        os.makedirs(root, exist_ok=True)
        tmp = os.path.join(root, _layout.tmp_name(step))
        final = os.path.join(root, _layout.step_name(step))
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            _fsops.rmtree(tmp)
        elif os.path.lexists(tmp):
            os.unlink(tmp)
        _fsops.mkdir(tmp)
        try:
            _fetch.download(remote, tmp)  # every byte checked as it lands
            _fsops.write_file(
                os.path.join(tmp, _manifest.MANIFEST), _manifest.dumps(remote.manifest)
            )
            _fsops.fsync_file(os.path.join(tmp, _manifest.MANIFEST))
            _fsops.fsync_dir(tmp)
            # The bytes were checked against the manifest as they landed; this checks the copy
            # as a local checkpoint (every file there with its size, the table parses).
            CheckpointReader(tmp).verify(checksums=False)
            if METRICS_FILE in remote.manifest["files"]:
                # Before the commit: a kill in between leaves no checkpoint without its log.
                _install_log(os.path.join(tmp, METRICS_FILE), os.path.join(run_dir, METRICS_FILE))
            if os.path.lexists(final):
                aside = os.path.join(root, f"unusable-{_layout.step_name(step)}-{int(time.time())}")
                os.rename(final, aside)
            _fsops.rename(tmp, final)
            _fsops.fsync_dir(root)
        except BaseException:
            if os.path.isdir(tmp):
                _fsops.rmtree(tmp)
            raise
        return final

    # ---- retention ----------------------------------------------------------------------------

    def apply_retention(self, newest: int, protect: Iterable[int] = ()) -> list[int]:
        """Delete complete checkpoints older than ``newest`` that the policy does not keep,
        and uploads that never committed, older than ``newest`` -- only if ``newest`` itself
        is complete (the newest complete checkpoint is never deleted)."""
        scan = self.scan()
        complete: list[int] = []
        for step in self.committed(scan):
            if step > newest:
                continue
            try:
                reader = self.reader(step, scan[step])
                reader.verify(checksums=False)
                complete.append(step)
            except UNUSABLE:
                continue  # not ours to delete: shown by `unbroken ls`
            if step == newest:  # objects an earlier, killed upload of this step left
                stale = set(scan[step]) - set(reader.manifest["files"]) - {_manifest.MANIFEST}
                self.objects.delete(f"{self._folder(step)}/{n}" for n in sorted(stale))
        if newest not in complete:
            return []
        r = self.retention
        keep = set(protect) | {newest}
        older = [s for s in complete if s < newest]
        keep |= set(older if r.keep_last is None else older[: r.keep_last - 1])
        if r.keep_every:
            keep |= {s for s in older if s % r.keep_every == 0}
        deleted = []
        for step in older:
            if step not in keep:
                self._delete(step, scan[step])
                deleted.append(step)
        for step, files in scan.items():
            if step < newest and step not in keep and _manifest.MANIFEST not in files:
                self._delete(step, files)  # an upload killed before its commit
        return deleted

    def _delete(self, step: int, files: dict[str, Any]) -> None:
        folder = self._folder(step)
        if _manifest.MANIFEST in files:  # the commit goes first: never a half-deleted checkpoint
            self.objects.delete([f"{folder}/{_manifest.MANIFEST}"])
        self.objects.delete(f"{folder}/{n}" for n in sorted(files) if n != _manifest.MANIFEST)

    def sweep_uploads(self, older_than: float) -> int:
        """Abort multipart uploads of killed processes (begun before ``older_than``)."""
        return self.objects.abort_uploads(_layout.CHECKPOINTS + "/", older_than)

    def supersede_newer(self, step: int) -> list[str]:
        """Move checkpoints newer than ``step`` to ``superseded-<time>/`` (server-side copies;
        resuming an older step forks history, and a relaunch must not take the newer ones)."""
        scan = self.scan()
        newer = sorted(s for s in scan if s > step)
        moved = []
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for s in newer:
            files = scan[s]
            if _manifest.MANIFEST in files:
                target = f"superseded-{stamp}/{_layout.step_name(s)}"
                for name in sorted(files):  # the manifest last, as in any upload
                    if name != _manifest.MANIFEST:
                        self.objects.copy(f"{self._folder(s)}/{name}", f"{target}/{name}")
                self.objects.copy(
                    f"{self._folder(s)}/{_manifest.MANIFEST}", f"{target}/{_manifest.MANIFEST}"
                )
                moved.append(self.objects.where(target))
            self._delete(s, files)
        if moved:
            _log.event(
                log,
                logging.WARNING,
                "unbroken: resumed from step %d, so newer remote checkpoints were moved aside "
                "(not deleted): %s",
                step,
                moved,
                step=step,
            )
        return moved


def _metrics_bytes(meta: dict[str, Any], path: str) -> int | None:
    """How much of the log belongs to the checkpoint: what it recorded, else whole lines."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return None
    n = meta.get("metrics_bytes")
    if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= size:
        return n
    with open(path, "rb") as f:
        data = f.read(size)
    return data.rfind(b"\n") + 1


def _hash_prefix(path: str, n: int) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while n > 0 and (chunk := f.read(min(n, 1 << 20))):
            h.update(chunk)
            n -= len(chunk)
    return h.hexdigest()


def _install_log(src: str, dst: str) -> None:
    """``dst`` becomes a copy of ``src``; a log already there is kept beside it, renamed."""
    import shutil

    tmp = dst + ".fetching"
    shutil.copyfile(src, tmp, follow_symlinks=False)
    _fsops.fsync_file(tmp)
    if os.path.lexists(dst):
        os.rename(dst, f"{dst}.replaced-{int(time.time())}")
    os.rename(tmp, dst)
    _fsops.fsync_dir(os.path.dirname(dst))
