"""Reading one checkpoint straight from an object store: the same checks, ranged GETs.

:class:`RemoteReader` is a :class:`CheckpointReader` whose bytes come from objects instead of
files, so a crafted remote checkpoint meets every refusal a local one does: the manifest's
schema and self-checksum, plain file names (a name is never a key outside its checkpoint),
strict bounded JSON, the tensor table validated against the sizes the listing confirmed before
anything is allocated, every chunk's xxh3. Nothing is unpickled; format 1 (pickled DCP
metadata) is not read from object stores at all.

Loading reads straight into the live tensors: each chunk's bytes are fetched by ranged GETs
into the tensor's own memory, :data:`_s3.THREADS` requests at a time, and hashed as soon as the
chunk is complete. Neighbouring chunks up to :data:`_s3.PART_BYTES` share one GET, its body
streamed into each chunk's tensor in turn (a request costs more than a few KiB); a larger chunk
is split into ranges fetched in parallel. Memory beyond the targets: the gaps between grouped
chunks (alignment: < 64 bytes each; never more than a group's span), plus one chunk where a
target cannot take the bytes as they are (another dtype, a device, a slice of a larger tensor).
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

from .._errors import ConfigError, CorruptCheckpointError
from . import _format, _manifest, _s3, _safeio, _table
from ._format import Chunk
from ._reader import CheckpointReader
from ._table import Table


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
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]

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
        for name, group in per_file.items():
            group.sort(key=lambda s: s.chunk.offset)
            tasks.extend(self._tasks(self.reader._name(name), group))
        with torch.no_grad():
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
        """Neighbouring small chunks share one GET; a large chunk is split into ranges."""
        tasks: list[Callable[[], None]] = []
        group: list[_Slot] = []
        for s in [*slots, None]:
            if group and (s is None or _span(group, s) > _s3.PART_BYTES):
                tasks.append(functools.partial(self._group, key, group))
                group = []
            if s is None:
                break
            if s.chunk.nbytes > _s3.PART_BYTES:
                s.pieces_left = -(-s.chunk.nbytes // _s3.PART_BYTES)
                for at in range(0, s.chunk.nbytes, _s3.PART_BYTES):
                    tasks.append(functools.partial(self._piece, key, s, at))
            else:
                group.append(s)
        return tasks

    def _group(self, key: str, group: list[_Slot]) -> None:
        """One GET for neighbouring chunks, streamed into each chunk's memory in file order;
        the alignment gaps between them go to a scratch buffer."""
        views: list[memoryview] = []
        pos = group[0].chunk.offset
        for s in group:
            gap = s.chunk.offset - pos
            if gap:
                views.append(memoryview(bytearray(gap)))
            views.append(s.memory())
            pos = s.chunk.offset + s.chunk.nbytes
        self.reader.objects.get_into_many(key, group[0].chunk.offset, views)
        for s in group:
            self._done(s)

    def _piece(self, key: str, s: _Slot, at: int) -> None:
        with self.lock:
            mem = s.memory()  # the staging tensor, if any, is made once
        n = min(_s3.PART_BYTES, s.chunk.nbytes - at)
        self.reader.objects.get_into(key, s.chunk.offset + at, mem[at : at + n])
        with self.lock:
            s.pieces_left -= 1
            last = s.pieces_left == 0
        if last:
            self._done(s)

    def _done(self, s: _Slot) -> None:
        digest = s.finish(self.verify)
        if digest is not None and digest != s.chunk.xxh3:
            with self.lock:
                self.bad.append(s.chunk)


def _span(group: list[_Slot], nxt: _Slot) -> int:
    return nxt.chunk.offset + nxt.chunk.nbytes - group[0].chunk.offset
