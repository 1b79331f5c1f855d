"""Reading one checkpoint straight from an object store: the same checks, ranged GETs.

:class:`RemoteReader` is a :class:`CheckpointReader` whose bytes come from objects instead of
files, so a crafted remote checkpoint meets every refusal a local one does: the manifest's
schema and self-checksum, plain file names (a name is never a key outside its checkpoint),
strict bounded JSON, the tensor table validated against the sizes the listing confirmed before
anything is allocated, every chunk's xxh3. Nothing is unpickled; format 1 (pickled DCP
metadata) is not read from object stores at all.

Loading reads straight into the live tensors: each chunk's bytes are fetched by ranged GETs
into the tensor's own memory, :data:`_s3.THREADS` requests at a time, and hashed as soon as the
chunk is complete. The wanted bytes of a data file are cut into equal ranges of at most
:data:`_s3.PART_BYTES` (:func:`ranges`), wherever chunks begin and end: a GET streams its body
into the end of one chunk, the small chunks after it and the start of the next, and a chunk
split across GETs is hashed by whichever completes it last. Memory beyond the targets: per GET
in flight, a scratch buffer as wide as the widest gap it skips (loading every tensor, the
< 64-byte alignment; never more than :data:`MAX_GAP`), and a staging tensor for each chunk in
flight whose target cannot take the bytes as they are (another dtype, a device, a slice of a
larger tensor).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from ...errors import ConfigError, CorruptCheckpointError
from .. import _format, _manifest, _safeio, _table
from .._format import Chunk
from .._reader import CheckpointReader
from .._table import Table
from . import _s3

MAX_GAP = 1 << 20
"""Chunks apart by at most this many bytes are read by one GET, the bytes between them
dropped (a request costs more than a MiB of transfer; see :func:`ranges`). Loading every
tensor, the gaps are the < 64-byte alignment; loading a few tensors, larger ones."""


class RemoteReader(CheckpointReader):
    """The checkpoint ``folder`` (e.g. ``checkpoints/step-000000100``) of ``objects``, whose
    objects the listing ``sizes`` ({file name: bytes}) says are there."""

    def __init__(self, objects: _s3.S3Objects, folder: str, sizes: dict[str, int]) -> None:
        self.objects, self.folder, self.sizes = objects, folder, dict(sizes)
        super().__init__(objects.where(folder))
        if self.format_version != _manifest.FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{self.path} is format {self.format_version}; object stores hold format "
                f"{_manifest.FORMAT_VERSION} only (unbroken never uploads format 1)",
                path=self.path,
                step=self.step,
            )

    def _name(self, name: Any) -> str:
        _safeio.safe_name(self.path, name)  # a plain name: never a key outside this checkpoint
        return f"{self.folder}/{name}"

    def _where(self, name: str) -> str:
        return f"{self.path}/{name}"

    def _listed(self, name: str, limit: int | None = None) -> int:
        size = self.sizes.get(name)
        if size is None:
            raise CorruptCheckpointError(f"{self._where(name)} is missing")
        if limit is not None and size > limit:
            raise CorruptCheckpointError(
                f"{self._where(name)} is {size} bytes, more than such a file holds"
            )
        return size

    def _io_manifest(self) -> dict[str, Any]:
        name = _manifest.MANIFEST
        size = self._listed(name, _manifest.MAX_MANIFEST_BYTES)
        raw = self.objects.get_bytes(self._name(name), size)
        where = self._where(name)
        return _manifest.check_manifest(_safeio.parse_json(raw, where), where)

    def _io_json(self, name: str) -> Any:
        return _safeio.parse_json(self._checked_bytes(name), self._where(name))

    def _io_table(self, sizes: dict[str, int]) -> Table:
        # The bounded streaming parser reads a file descriptor: the fetched (and checksummed)
        # table goes into an anonymous memory file, never onto a disk.
        name = _format.TABLE_FILE
        raw = self._checked_bytes(name)
        fd = os.memfd_create("unbroken-table", os.MFD_CLOEXEC)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            os.lseek(fd, 0, os.SEEK_SET)
            return _table.read(fd, self._where(name), sizes)
        finally:
            os.close(fd)

    def _checked_bytes(self, name: str) -> bytes:
        """The bytes of the listed JSON file ``name``, its size and checksum the manifest's."""
        rec = self.manifest["files"].get(name)
        size = self._listed(name, _safeio.MAX_JSON_BYTES)
        where = self._where(name)
        if rec is None or rec["size"] != size:
            raise CorruptCheckpointError(f"{where} is not the file the manifest lists")
        raw = self.objects.get_bytes(self._name(name), size)
        if xxhash.xxh3_64_hexdigest(raw) != rec["xxh3_64"]:
            # Fetched whole anyway: checking it costs nothing and a bad one is never parsed.
            raise CorruptCheckpointError(f"{where} does not match its xxh3 checksum (corrupted)")
        return raw

    def _io_verify_files(self, checksums: bool, skip: set[str]) -> None:
        todo = []
        for name, rec in sorted(self.manifest["files"].items()):
            key = self._name(name)
            size = self._listed(name)
            if size != rec["size"]:
                raise CorruptCheckpointError(
                    f"{self._where(name)} has {size} bytes, the manifest says {rec['size']} "
                    "(truncated?)"
                )
            if checksums and name not in skip:
                todo.append((name, key, size, rec["xxh3_64"]))
        digests = _each(todo, lambda t: hash_range(self.objects, t[1], 0, t[2]))
        for (name, _, _, want), got in zip(todo, digests, strict=True):
            if got != want:
                raise CorruptCheckpointError(
                    f"{self._where(name)} does not match its xxh3 checksum (corrupted)"
                )

    def _io_verify_data(self, table: Table) -> None:
        per_file = {
            name: [table.chunk(int(j)) for j in order]
            for name, order in table.in_file_order().items()
        }
        jobs = [(name, c) for name, chunks in per_file.items() for c in chunks]
        digests = _each(
            jobs, lambda j: hash_range(self.objects, self._name(j[0]), j[1].offset, j[1].nbytes)
        )
        got = dict(zip(((n, c.offset) for n, c in jobs), digests, strict=True))
        for name, chunks in per_file.items():
            for c in chunks:
                if got[(name, c.offset)] != c.xxh3:
                    raise CorruptCheckpointError(
                        f"{self._where(name)} does not match its xxh3 checksum (corrupted) in "
                        f"tensor {c.fqn!r}"
                    )
            rec = self.manifest["files"].get(name)
            if rec is None or rec["xxh3_64"] != _format.combine([c.xxh3 for c in chunks]):
                raise CorruptCheckpointError(
                    f"{self._where(name)} does not match its checksum in the manifest"
                )

    def _io_load(self, table: Table, targets: dict[str, torch.Tensor], verify: bool) -> None:
        _RemoteLoad(self, table, verify).run(targets)


def hash_range(objects: _s3.S3Objects, key: str, offset: int, nbytes: int) -> str:
    """xxh3-64 of bytes [offset, offset + nbytes) of an object, read in bounded pieces."""
    h = xxhash.xxh3_64()
    buf = bytearray(min(nbytes, _s3.PART_BYTES))
    done = 0
    while done < nbytes:
        n = min(len(buf), nbytes - done)
        view = memoryview(buf)[:n]
        objects.get_into(key, offset + done, view)
        h.update(view)
        done += n
    return h.hexdigest()


def _each(items: list[Any], fn: Callable[[Any], Any]) -> list[Any]:
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(_s3.THREADS, thread_name_prefix="unbroken-get") as pool:
        return list(pool.map(fn, items))


class _Slot:
    """Where one chunk's bytes land: the target itself, or a staging tensor copied over."""

    def __init__(self, chunk: Chunk, target: torch.Tensor, dtype: torch.dtype) -> None:
        self.chunk, self.target, self.dtype = chunk, target, dtype
        whole = tuple(target.shape) == chunk.sizes and not any(chunk.offsets)
        self.direct = (
            whole
            and target.device.type == "cpu"
            and target.is_contiguous()
            and target.dtype == dtype
        )
        self.stage: torch.Tensor | None = None
        self.pieces_left = 0

    def memory(self) -> memoryview:
        if self.direct:
            t = self.target
        else:
            if self.stage is None:
                self.stage = torch.empty(self.chunk.sizes, dtype=self.dtype)
            t = self.stage
        # TensorBase's own numpy(): not the one the snapshots watch (train/_data_watch.py)
        return memoryview(torch._C.TensorBase.numpy(t.reshape(-1).view(torch.uint8)))  # type: ignore[arg-type]

    def finish(self, verify: bool) -> str | None:
        """The chunk's bytes are all there: hash them, then move them into the target."""
        digest = xxhash.xxh3_64_hexdigest(self.memory()) if verify else None
        if not self.direct:
            assert self.stage is not None
            region = self.target
            for dim, (o, s) in enumerate(zip(self.chunk.offsets, self.chunk.sizes, strict=True)):
                region = region.narrow(dim, o, s)
            region.copy_(self.stage)
            self.stage = None
        return digest


class _RemoteLoad:
    def __init__(self, reader: RemoteReader, table: Table, verify: bool) -> None:
        self.reader, self.table, self.verify = reader, table, verify
        self.lock = threading.Lock()
        self.bad: list[Chunk] = []

    def run(self, targets: dict[str, torch.Tensor]) -> None:
        slots = self._slots(targets)
        per_file: dict[str, list[_Slot]] = {}
        for s in slots:
            per_file.setdefault(s.chunk.file, []).append(s)
        tasks: list[Callable[[], None]] = []
        with torch.no_grad():
            for name, group in per_file.items():
                group.sort(key=lambda s: s.chunk.offset)
                tasks.extend(self._tasks(self.reader._name(name), group))
            _each(tasks, lambda t: t())
        if self.bad:
            c = min(self.bad, key=lambda c: (c.file, c.offset))
            raise CorruptCheckpointError(
                f"{self.reader._where(c.file)} does not match its xxh3 checksum (corrupted) in "
                f"tensor {c.fqn!r} (bytes {c.offset}...{c.offset + c.nbytes})"
            )

    def _slots(self, targets: dict[str, torch.Tensor]) -> list[_Slot]:
        slots: list[_Slot] = []
        for fqn, target in targets.items():
            entry = self.table.get(fqn)
            if entry is None:
                raise CorruptCheckpointError(f"{self.reader.path} holds no tensor {fqn!r}")
            if type(target) not in (torch.Tensor, torch.nn.Parameter):
                raise ConfigError(
                    f"tensor {fqn!r}: a {type(target).__name__} cannot be loaded straight from "
                    "an object store; let the run fetch the checkpoint into its directory"
                )
            if tuple(target.shape) != entry.shape:
                raise CorruptCheckpointError(
                    f"{self.reader.path}: tensor {fqn!r} has shape {list(entry.shape)}, the "
                    f"target {list(target.shape)}"
                )
            slots.extend(_Slot(c, target.detach(), entry.dtype) for c in entry.chunks)
        return slots

    def _tasks(self, key: str, slots: list[_Slot]) -> list[Callable[[], None]]:
        """One GET per range of :func:`ranges`, each feeding the chunks it overlaps."""
        live = []
        for s in slots:
            if s.chunk.nbytes:
                live.append(s)
            else:
                self._done(s)  # nothing to fetch (its checksum is still compared)
        tasks: list[Callable[[], None]] = []
        for start, parts in ranges([(s.chunk.offset, s.chunk.nbytes) for s in live]):
            pieces = [(live[i], lo, hi) for i, lo, hi in parts]
            for s, _, _ in pieces:
                s.pieces_left += 1
            tasks.append(functools.partial(self._get, key, start, pieces))
        return tasks

    def _get(self, key: str, start: int, pieces: list[tuple[_Slot, int, int]]) -> None:
        """One ranged GET streamed into each piece's memory in file order; the alignment gaps
        between chunks go to one scratch buffer (read and dropped)."""
        with self.lock:
            mems = [s.memory() for s, _, _ in pieces]  # a staging tensor is made once
        gaps, pos = [], start
        for s, lo, hi in pieces:
            gaps.append(s.chunk.offset + lo - pos)
            pos = s.chunk.offset + hi
        scratch = memoryview(bytearray(max(gaps)))  # the widest gap: gaps are read in turn
        views: list[memoryview] = []
        for (_, lo, hi), gap, mem in zip(pieces, gaps, mems, strict=True):
            if gap:
                views.append(scratch[:gap])
            views.append(mem[lo:hi])
        self.reader.objects.get_into_many(key, start, views)
        with self.lock:
            complete = []
            for s, _, _ in pieces:
                s.pieces_left -= 1
                if s.pieces_left == 0:
                    complete.append(s)
        for s in complete:
            self._done(s)

    def _done(self, s: _Slot) -> None:
        digest = s.finish(self.verify)
        if digest is not None and digest != s.chunk.xxh3:
            with self.lock:
                self.bad.append(s.chunk)


def ranges(spans: list[tuple[int, int]]) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """The ranged GETs that read ``spans`` ((offset, nbytes) of the chunks wanted from one
    object, in file order, none empty or overlapping): [(start, [(span index, lo, hi)])], each
    GET reading from ``start`` the bytes [lo, hi) of each span listed, in order.

    Spans whose gaps are at most :data:`MAX_GAP` form one run, cut into equal ranges of at
    most :data:`_s3.PART_BYTES` regardless of where chunks begin and end, so that no GET is
    left half full. Cutting at chunk boundaries instead left 4 MiB tensors
    alone in 8 MiB groups, twice the requests, and each request has a fixed cost (measured
    ~8 ms for one byte from SeaweedFS on 127.0.0.1: bench/bench_remote.py)."""
    out: list[tuple[int, list[tuple[int, int, int]]]] = []
    i = 0
    while i < len(spans):
        j = i + 1  # the run is spans[i:j]
        while j < len(spans) and spans[j][0] - sum(spans[j - 1]) <= MAX_GAP:
            j += 1
        first, end = spans[i][0], sum(spans[j - 1])
        n = -(-(end - first) // _s3.PART_BYTES)
        size = -(-(end - first) // n)
        k = i
        for lo in range(first, end, size):
            hi = min(lo + size, end)
            parts = []
            while k < j and spans[k][0] < hi:
                off, nbytes = spans[k]
                a, b = max(lo, off), min(hi, off + nbytes)
                if a < b:
                    parts.append((k, a - off, b - off))
                if off + nbytes > hi:
                    break  # continues in the next range
                k += 1
            if parts:
                out.append((spans[parts[0][0]][0] + parts[0][1], parts))
        i = j
    return out
