"""Moving tensor bytes between memory and a format-2 data file at the disk's speed.

Writing (bench/bench_checkpoint.py measured each choice on the 1 GB state): the chunks are
copied into a few page-aligned staging buffers and hashed there (xxh3, which releases the GIL)
by the calling thread, while two writer threads ``pwrite`` full buffers with ``O_DIRECT``. The
copy and hash (~0.12 s/GB) hide behind the writes (~0.36 s/GB); through the page cache the
same bytes took 2-8x longer on this disk (dirty-page writeback, then fsync). Where ``O_DIRECT``
is refused (some tmpfs and network file systems) each tensor is hashed and written from its
own memory instead, the page cache being the staging. The caller fsyncs the file.

Reading: one ``preadv`` per chunk straight into the destination tensor's memory (no staging,
no extra resident copy), then the chunk's xxh3 computed on the destination while it is hot in
the cache, so that verification costs no second pass over the disk. Hashing in a second thread
pipelined with the reads was measured slower on 2 cores (1.47x the ``readinto`` floor against
1.22x inline, interleaved A/B on the 1 GB state): the hand-offs cost more than xxh3 itself
(~25 GB/s). :meth:`VerifiedReads.many` instead gives whole chunks (read, then hash) to a few
threads (store/_par.py).
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import xxhash

from ..errors import CorruptCheckpointError
from . import _fsops, _par, _safeio
from ._format import ALIGN, Chunk
from ._tablefile import hash_chunks as hash_chunks

# From huge pages, 8-32 MiB stages and 2-4 writers measured alike (0.95-1.01x the ceiling,
# 1 GB, 2026-12-03); from 4 KiB pages 16 MiB stages had been 1.6x slower and a second
# writer 4% faster.
STAGE_BYTES = 32 << 20
STAGES = 4
WRITERS = 2
BLOCK = 4096
FIRST_BYTES = 4 << 20  # a multiple of BLOCK
HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
READ_PIECE = 1 << 20  # hashed while hot: 0.157 s vs 0.169 s a whole chunk at once (1 GB, warm)


@contextmanager
def one_thread() -> Iterator[None]:
    # A copy_ loop over many tensors is memcpy-bound: with 2+ intra-op threads it is several
    # times slower on a small machine (measured: 7x for 200 x 5 MB on 2 cores), and here the
    # threads would also fight the writer thread for the cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class _Stages:
    """Page-aligned staging buffers, kept for the life of the process (one save at a time).

    They are one private anonymous mapping asked for transparent huge pages
    (``MADV_HUGEPAGE``; this kernel's default is ``madvise``), each stage starting on a 2 MiB
    boundary. An ``O_DIRECT`` write is DMA'd from the buffer's physical pages, and the block
    layer merges only physically adjacent pages into one segment (virtio-blk here: at most 254
    segments a request), so scattered 4 KiB pages split each write into many small requests.
    Measured (O_DIRECT + fsync of 1 GB, 6 interleaved repeats): 0.36 s from huge pages against
    0.52 s from the 4 KiB pages of the same kind of mapping, and 0.39 s from a shared one --
    the "placement" noise earlier benches saw. Where huge pages are not granted the stages
    still work, as before.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self.tensors: list[torch.Tensor] = []
        self._views: list[memoryview] = []

    def ensure(self) -> None:
        if self._map is not None:
            return
        size = STAGES * STAGE_BYTES + HUGE
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        m = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass  # no THP here: 4 KiB pages, slower under O_DIRECT but correct
        whole = torch.frombuffer(m, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE
        for i in range(STAGES):
            at = skip + i * STAGE_BYTES
            self.tensors.append(whole[at : at + STAGE_BYTES])
            self._views.append(memoryview(m)[at : at + STAGE_BYTES])
        self._map = m

    def view(self, i: int) -> memoryview:
        return self._views[i]


_stages = _Stages()


_NO_DIRECT: set[int] = set()  # file systems (st_dev) that refused O_DIRECT: not asked again


def _open_for_write(path: str) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    direct = getattr(os, "O_DIRECT", 0)
    dev = os.stat(os.path.dirname(path) or ".").st_dev
    if direct and dev not in _NO_DIRECT:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _NO_DIRECT.add(dev)
            if os.path.lexists(path):
                os.unlink(path)  # created, then O_DIRECT refused: start again without it
    return os.open(path, flags, 0o644), False


class _Writer:
    """The writer threads (:data:`WRITERS`): take (stage, nbytes, file offset) jobs in any order
    (each writes its own file range), give the stage back."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self.jobs: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(STAGES):
            self.free.put(i)
        self.error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._run, name="unbroken-write", daemon=True)
            for _ in range(WRITERS)
        ]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            stage, nbytes, offset = job
            try:
                if self.error is None:
                    _pwrite_all(self.fd, _stages.view(stage)[:nbytes], offset)
            except BaseException as e:  # re-raised by the producer, with the path
                self.error = e
            finally:
                self.free.put(stage)

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        view, offset = view[n:], offset + n


def write_chunks(path: str, tensors: Iterable[tuple[Any, torch.Tensor]]) -> tuple[list, int]:
    """Create ``path`` holding every tensor's bytes; returns ([(key, offset, nbytes, xxh3)],
    file size). Errors are OSErrors naming ``path`` (the disk's own errno kept)."""
    _fsops.event("create", path)
    with _stages.lock, one_thread():
        _stages.ensure()
        fd, direct = _open_for_write(path)
        try:
            if direct:
                out, size = _produce(fd, path, tensors)
            else:
                out, size = _produce_buffered(fd, path, tensors)
            os.ftruncate(fd, size)  # the last stage was written padded to a whole block
        except OSError as e:
            if e.filename is None:
                raise OSError(e.errno, e.strerror, path) from e
            raise
        finally:
            os.close(fd)
    _fsops.event("close", path)
    return out, size


def _produce(fd: int, path: str, tensors: Iterable[tuple[Any, torch.Tensor]]) -> tuple[list, int]:
    writer = _Writer(fd, path)
    out: list[tuple[Any, int, int, str]] = []
    stage, fill, base = writer.free.get(), 0, 0  # base: file offset of the stage's first byte
    # The disk idles until the first stage is full: the first one goes out at FIRST_BYTES.
    cap = min(FIRST_BYTES, STAGE_BYTES)
    started = False

    def flush(final: bool = False) -> None:
        nonlocal stage, fill, base, cap
        n = fill
        if final and n % BLOCK:
            pad = BLOCK - n % BLOCK
            _stages.tensors[stage][n : n + pad].zero_()
            n += pad
        writer.jobs.put((stage, n, base))
        base += fill
        fill, cap = 0, STAGE_BYTES
        if not final:
            stage = writer.free.get()
            if writer.error is not None:
                raise writer.error

    try:
        pos = 0
        for key, t in tensors:
            if not started:
                started = True
                _fsops.event("write", path)
            t = t.detach()
            start = -(-pos // ALIGN) * ALIGN
            gap = start - pos
            while gap:
                n = min(gap, cap - fill)
                _stages.tensors[stage][fill : fill + n].zero_()
                fill, gap = fill + n, gap - n
                if fill == cap:
                    flush()
            nbytes = t.numel() * t.element_size()
            h = xxhash.xxh3_64()
            if nbytes and nbytes <= cap - fill:
                # Fits: one copy_ from the tensor's own layout (any strides, any device).
                dst = _stages.tensors[stage][fill : fill + nbytes]
                dst.view(t.dtype).view(t.shape).copy_(t)
                h.update(_stages.view(stage)[fill : fill + nbytes])
                fill += nbytes
            elif nbytes:
                flat = t.contiguous().cpu().reshape(-1).view(torch.uint8)
                done = 0
                while done < nbytes:
                    if fill == cap:
                        flush()
                    n = min(nbytes - done, cap - fill)
                    _stages.tensors[stage][fill : fill + n].copy_(flat[done : done + n])
                    h.update(_stages.view(stage)[fill : fill + n])
                    fill, done = fill + n, done + n
            if fill == cap:
                flush()
            out.append((key, start, nbytes, h.hexdigest()))
            pos = start + nbytes
        flush(final=True)
    finally:
        writer.close()
    if writer.error is not None:
        raise writer.error
    return out, pos


def _produce_buffered(
    fd: int, path: str, tensors: Iterable[tuple[Any, torch.Tensor]]
) -> tuple[list, int]:
    """Without O_DIRECT (some tmpfs; in-memory snapshots use store/snapshot/_slots.py instead): the
    page cache is the staging, so a contiguous CPU tensor is hashed and ``pwrite``n from its
    own memory -- one copy, not two (measured 1.6x faster for a 1 GB file into /dev/shm).
    Gaps stay holes (read as zeros)."""
    out: list[tuple[Any, int, int, str]] = []
    pos = 0
    started = False
    for key, t in tensors:
        if not started:
            started = True
            _fsops.event("write", path)
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.contiguous().cpu()
        start = -(-pos // ALIGN) * ALIGN
        nbytes = t.numel() * t.element_size()
        view = memoryview(b"")
        if nbytes:
            # TensorBase's own numpy(): not the one the snapshots watch (train/_data_watch.py)
            view = memoryview(torch._C.TensorBase.numpy(t.reshape(-1).view(torch.uint8)))  # type: ignore[arg-type]
        digest = xxhash.xxh3_64_hexdigest(view)
        _pwrite_all(fd, view, start)
        out.append((key, start, nbytes, digest))
        pos = start + nbytes
    return out, pos


class VerifiedReads:
    """Read chunks of one data file into tensors, hashing each as it lands; :meth:`finish`
    raises CorruptCheckpointError naming the first chunk whose bytes do not match."""

    def __init__(self, path: str, verify: bool = True) -> None:
        self.path = path
        self.fd = _safeio.open_regular(path)
        self.verify = verify
        self.pending: list[tuple[Chunk, str]] = []
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def into(self, chunk: Chunk, dest: torch.Tensor) -> None:
        """Fill ``dest`` (contiguous CPU, ``chunk.nbytes`` bytes) with the chunk."""
        digest = self._read(chunk, dest)
        if digest is not None:
            self.pending.append((chunk, digest))

    def many(self, pairs: list[tuple[Chunk, torch.Tensor]]) -> None:
        """:meth:`into` for each (chunk, dest), in several threads when there is enough."""
        nbytes = sum(c.nbytes for c, _ in pairs)
        digests = _par.each(pairs, lambda p: self._read(*p), nbytes)
        self.pending.extend((c, d) for (c, _), d in zip(pairs, digests, strict=True) if d)

    def _read(self, chunk: Chunk, dest: torch.Tensor) -> str | None:
        if not chunk.nbytes:
            return xxhash.xxh3_64_hexdigest(b"") if self.verify else None
        # TensorBase's own numpy(): not the one the snapshots watch (train/_data_watch.py)
        view = memoryview(torch._C.TensorBase.numpy(dest.reshape(-1).view(torch.uint8)))  # type: ignore[arg-type]
        h = xxhash.xxh3_64() if self.verify else None
        got, offset = 0, chunk.offset
        while got < chunk.nbytes:
            # In pieces, each hashed right after it is read, while it is hot in the cache.
            end = min(chunk.nbytes, got + READ_PIECE) if h is not None else chunk.nbytes
            n = os.preadv(self.fd, [view[got:end]], offset + got)
            if n <= 0:
                raise CorruptCheckpointError(f"{self.path}: tensor {chunk.fqn!r} is truncated")
            if h is not None:
                h.update(view[got : got + n])
            got += n
        return h.hexdigest() if h is not None else None

    def new(self, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(chunk.sizes, dtype=dtype)
        self.into(chunk, t)
        return t

    def check(self) -> None:
        """Raise for the first chunk read so far whose bytes do not match; forget the rest."""
        pending, self.pending = self.pending, []
        for chunk, got in pending:
            if got != chunk.xxh3:
                raise CorruptCheckpointError(
                    f"{self.path} does not match its xxh3 checksum (corrupted) in tensor "
                    f"{chunk.fqn!r} (bytes {chunk.offset}...{chunk.offset + chunk.nbytes})"
                )

    def finish(self) -> None:
        os.close(self.fd)
        self.check()

    def abandon(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
