"""Two fixed slots per rank for in-memory snapshots, overwritten in place (the double buffer).

Writing each snapshot as fresh tmpfs files cost 6x a ``copy_`` of the state
(bench/bench_snapshot.py, 1 GB: 0.52 s against 0.08 s): the kernel allocates and zeroes a new
page for every 4 KiB written, and deleting the previous snapshot frees its pages again. Here
each rank keeps two data files in ``<area>/slots/`` (``tensors-rRRRRR.bin.0`` and ``.1``),
created once, mapped once for the life of the process (so neither the pages nor the page
tables are built again) and overwritten in place: a snapshot's tensor payload is one memcpy of
each tensor into the slot, and its xxh3 computed right after, while the bytes are hot.

The commit stays the store's, unchanged: the slot is hard-linked into the snapshot's
``.tmp-step-N`` directory under the data file's name, the JSON files and the manifest are
written beside it, and the directory is renamed to ``step-N``. Which slot to overwrite is the
double buffer's rule: never the one the newest committed snapshot links. So while one slot is
being overwritten the other is the complete previous snapshot; a kill mid-copy leaves a torn
slot linked only from a ``.tmp-`` directory (removed by ``clean_stale``) or from an older,
superseded snapshot -- whose chunks then fail their checksums, so it is never committed.
Readers (persist, restore from memory) see an ordinary format-2 checkpoint directory.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from ...errors import UnsafeCheckpointError
from .. import _direct, _fsops, _layout, _par
from .._format import ALIGN
from .._host_buffers import Stage

SLOTS = "slots"
_EMPTY = xxhash.xxh3_64_hexdigest(b"")


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate every page of the slot now. Written through a mapping, a sparse tmpfs file
    takes its pages at the first touch -- and a full /dev/shm then kills the process with
    SIGBUS in the middle of a copy. Here a full one is an ENOSPC, raised before anything is
    written (the snapshot fails cleanly and snapshots turn off); the file goes back to 0."""
    if not size:
        return
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            zeros = bytes(1 << 20)  # no fallocate here: writing allocates as well
            for at in range(0, size, len(zeros)):
                os.pwrite(fd, zeros[: min(len(zeros), size - at)], at)
    except OSError as e:
        os.ftruncate(fd, 0)
        raise OSError(e.errno, e.strerror, path) from None


class _Slot:
    """One slot file, mapped shared and writable, every page allocated."""

    def __init__(self, path: str, size: int, layout: list[Any]) -> None:
        self.path, self.size, self.layout = path, size, layout
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise UnsafeCheckpointError(f"{path} is not a snapshot slot of this user")
            # A new layout (or a slot left by an earlier process, whose layout is unknown):
            # truncating to 0 first makes the gaps between chunks zero, as format 2 says.
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
            _reserve(fd, size, path)
            self.ino = (st.st_dev, st.st_ino)
            self.map = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        self.view = memoryview(self.map) if self.map is not None else memoryview(b"")
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8) if self.map is not None else None
        # Each chunk's destination, typed and shaped, made once per layout: slicing and viewing
        # cost several microseconds per tensor per snapshot, as much as copying a small one.
        self.dsts: list[torch.Tensor | None] = []
        for start, nbytes, dtype, shape in layout:
            if nbytes and self.bytes is not None:
                self.dsts.append(self.bytes[start : start + nbytes].view(dtype).view(shape))
            else:
                self.dsts.append(None)

    def close(self) -> None:
        self.bytes = None
        self.dsts = []
        self.view.release()
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes when it does


class Slots:
    """The slots of one snapshot area, as seen by one process (one rank)."""

    def __init__(self, area_root: str) -> None:
        self.root = area_root
        self.dir = os.path.join(area_root, SLOTS)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._open: dict[tuple[str, int], _Slot] = {}
        self._current: dict[str, int] = {}  # data file -> the slot its newest commit links
        self._pending: dict[str, int] = {}  # written for the save in progress
        self._names: set[str] = set()  # the data files this process (rank) writes
        self._stage = Stage()  # pinned host buffers for GPU tensors
        # A snapshot taken in the background (train/_snapshots.py): the writing thread calls
        # ``gate.copied()`` once every tensor is in the slot (the training may change them
        # from then on), then hashes the slot; the training's verdict on the copy comes before
        # the commit (CheckpointStore.save's ``before_commit``).
        self.gate: Any = None

    def path(self, name: str, idx: int) -> str:
        return os.path.join(self.dir, f"{name}.{idx}")

    def write_chunks(
        self, path: str, tensors: Iterable[tuple[Any, torch.Tensor]]
    ) -> tuple[list, int]:
        """Like ``_direct.write_chunks``: ``path`` holds every tensor's bytes (as a hard link to
        the free slot); returns ([(key, offset, nbytes, xxh3)], file size)."""
        name = os.path.basename(path)
        self._names.add(name)
        idx = 1 - self._in_use(name)
        items = self._on_host([(key, t.detach()) for key, t in tensors])
        layout, pos = [], 0
        for _, t in items:
            start = -(-pos // ALIGN) * ALIGN
            nbytes = t.numel() * t.element_size()
            layout.append((start, nbytes, t.dtype, t.shape))
            pos = start + nbytes
        slot = self._slot(name, idx, pos, layout)
        view = slot.view

        gate = self.gate

        def digest(i: int) -> str:
            if slot.dsts[i] is None:
                return _EMPTY
            start, nbytes = layout[i][0], layout[i][1]
            return xxhash.xxh3_64_hexdigest(view[start : start + nbytes])

        def copy(i: int) -> str:
            dst = slot.dsts[i]
            if dst is None:
                return _EMPTY
            dst.copy_(items[i][1])
            # Hashed at once, while the bytes are hot -- unless the training waits for the
            # copy (a snapshot in the background): then the slot is hashed after the copy,
            # while the training goes on, from memory the training does not touch.
            return "" if gate is not None else digest(i)

        with _direct.one_thread():
            # The first tensor in this thread, then the event, announced once the slot is
            # partly overwritten (a kill at it is a kill in the middle of the copy).
            hit = next((i for i, d in enumerate(slot.dsts) if d is not None), None)
            first = len(items) if hit is None else hit + 1
            digests = [copy(i) for i in range(first)]
            if hit is not None:
                _fsops.event("write", slot.path)
            digests += _par.each(range(first, len(items)), copy, pos)
            if gate is not None:
                gate.copied()
                digests = _par.each(range(len(items)), digest, pos)
        out = [
            (key, start, nbytes, digest)
            for (key, _), (start, nbytes, _, _), digest in zip(items, layout, digests, strict=True)
        ]
        _fsops.event("link", path)
        os.link(slot.path, path, follow_symlinks=False)
        self._pending[name] = idx
        return out, pos

    def _on_host(self, items: list[tuple[Any, torch.Tensor]]) -> list[tuple[Any, torch.Tensor]]:
        """GPU tensors copied first into reused pinned buffers (at the link's speed, where a
        copy into the pageable slot mapping would crawl); CPU tensors as they are."""
        gpu = [i for i, (_, t) in enumerate(items) if t.device.type == "cuda"]
        if not gpu:
            return items
        host = self._stage.copy([str(items[i][0]) for i in gpu], [items[i][1] for i in gpu])
        out = list(items)
        for i, t in zip(gpu, host.wait(), strict=True):
            out[i] = (items[i][0], t)
        return out

    def committed(self) -> None:
        """The save in progress committed: its slots are now the ones not to overwrite."""
        self._current.update(self._pending)
        self._pending.clear()

    def aborted(self) -> None:
        self._pending.clear()

    def close(self) -> None:
        for s in self._open.values():
            s.close()
        self._open.clear()

    def _slot(self, name: str, idx: int, size: int, layout: list[Any]) -> _Slot:
        s = self._open.get((name, idx))
        if s is not None and s.size == size and s.layout == layout:
            return s
        if s is not None:
            s.close()
        s = self._open[(name, idx)] = _Slot(self.path(name, idx), size, layout)
        return s

    def _in_use(self, name: str) -> int:
        """The slot not to overwrite: the one the newest committed snapshot links (a fresh
        process, a relaunch, finds it on disk); -> 1 when none does (slot 0 is written first)."""
        if name in self._current:
            return self._current[name]
        linked = self._linked(name)
        return 1 if linked is None else linked

    def _linked(self, name: str) -> int | None:
        """The slot of ``name`` a committed snapshot of the area links (by inode), if any."""
        inodes = {}
        for idx in (0, 1):
            try:
                st = os.stat(self.path(name, idx), follow_symlinks=False)
                inodes[(st.st_dev, st.st_ino)] = idx
            except FileNotFoundError:
                pass
        for _, ckpt in _layout.scan(self.root):
            try:
                st = os.stat(os.path.join(ckpt, name), follow_symlinks=False)
            except FileNotFoundError:
                continue
            got = inodes.get((st.st_dev, st.st_ino))
            if got is not None:
                return got
        return None

    def release_unused(self) -> None:
        """Unmap this rank's slots and give back the memory of those no committed snapshot
        links (snapshots are off: the newest one stays complete for the supervisor)."""
        self.close()
        for name in self._names:
            keep = self._current.get(name, self._linked(name))
            for idx in (0, 1):
                if idx == keep:
                    continue
                try:
                    fd = os.open(self.path(name, idx), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                        os.ftruncate(fd, 0)
                finally:
                    os.close(fd)

    def used_bytes(self) -> int:
        """Bytes the area's files take, each inode once (the slots are linked from the
        checkpoint directories)."""
        seen: dict[tuple[int, int], int] = {}
        dirs = [self.dir] + [p for _, p in _layout.scan(self.root)]
        for d in dirs:
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for e in entries:
                st = e.stat(follow_symlinks=False)
                seen[(st.st_dev, st.st_ino)] = st.st_size
        return sum(seen.values())
