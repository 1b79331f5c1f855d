"""Durable save and warm load of a ~1 GB transformer-shaped state: unbroken against the rest.

    .venv/bin/python bench/bench_checkpoint.py [--quick] [--repeats N] [--dir DIR]

The state is a GPT-shaped model (16 blocks of width 640, an 8192-token embedding: 84.7 M
float32 parameters in 196 tensors) plus Adam's ``step``, ``exp_avg`` and ``exp_avg_sq`` for
every parameter: 784 tensors, 1.016 GB, filled with random values (a virtual disk may skip
zeros). Every variant saves or loads the same tensors; throughputs are state bytes / seconds.

Save (every variant durable: its files fsynced before the clock stops):
  unbroken sync     ``CheckpointStore.save(step, registry.collect(), meta)``: format 2 (raw
                    bytes, O_DIRECT pipelined writer, xxh3 per chunk while staging) + fsync +
                    manifest + rename, as ``Run.save()`` does
  unbroken async    ``AsyncSaver.save``: blocking = what the caller waits for (collect +
                    snapshot into reused buffers + starting the writer thread), of which the
                    snapshot alone (``last_blocking_seconds``); total = until the background
                    write committed (nothing else running)
  torch.save        of {model, optimizer} state dicts, + fsync of the file and its directory
  safetensors       ``save_file`` of the flat tensors, + fsync of the file and its directory
  DCP               stock ``dcp.save`` with ``FileSystemWriter(sync_files=True)``
  disk ceiling      O_DIRECT writes of as many bytes from an aligned 64 MiB buffer in
                    transparent huge pages, + fsync (plain writes + fsync if O_DIRECT is
                    refused; the table says so); also from a buffer of 4 KiB pages, whose
                    physical scatter splits each write into more requests (store/_direct.py)
  buffered          the raw bytes, one ``write`` per tensor through the page cache, writeback
                    started every 32 MiB (``sync_file_range``), fsync: the best a buffered
                    writer does on this disk
  copy floor        ``copy_`` into preallocated buffers with one intra-op thread (memcpy)

Load (warm: every file was read once before, so it is in the page cache), into the live
tensors of an existing model and optimizer:
  unbroken          open + verify the JSON files + ``Registry.plan`` +
                    ``CheckpointReader.load_tensors`` (every chunk's xxh3 computed while it is
                    read) + ``Registry.restore``: one pass, as ``Run``
                    resumes in one process
  unbroken 2-pass   the same, with a full checksum pass over the data files first (what
                    ``unbroken verify``/``ls`` and a multi-rank resume's rank 0 do)
  unbroken no-verify the same without any checksum (sizes are still checked)
  torch.load        ``mmap=True, weights_only=True``, then ``load_state_dict`` / ``copy_`` into
                    the live tensors
  safetensors       ``load_file``, then ``copy_`` into the live tensors
  DCP               stock ``dcp.load`` into the live tensors
  readinto floor    ``readinto`` of the raw bytes (one file) into every live tensor

Cold load (``--cold``, root only): the same loads after ``echo 3 > /proc/sys/vm/drop_caches``,
for unbroken (one pass), safetensors and the readinto floor.

Peak extra resident memory of each load is measured once per variant in a fresh subprocess:
``ru_maxrss`` after the load minus before it, with the live state already built and touched.

World size (issue #5): the unbroken save and load (as ``Run`` does them: rank 0 verifies
checksums, every rank restores) of a ~0.25 GB state, in 1 process and in 2 gloo ranks on
127.0.0.1, replicated (DDP-like plain tensors) and sharded (FSDP2 ``fully_shard``).

Variants run interleaved (each repeat runs every variant once, in rotated order) after one
untimed warm-up round; the tables show medians and (min..max). The last line is one JSON
object (``ok`` per target; ``spread_s`` holds every min and max).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import xxhash
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from unbroken.state import Registry  # noqa: E402
from unbroken.store import AsyncSaver, CheckpointReader, CheckpointStore  # noqa: E402

# (width, blocks, vocab, context)
SHAPES = {
    "full": (640, 16, 8192, 1024),  # 84.7 M parameters, 1.016 GB with Adam's moments
    "quick": (256, 8, 4096, 512),  # 7.5 M parameters, 0.09 GB
    "world": (352, 12, 8192, 1024),  # 21.1 M parameters, 0.25 GB
    "world-quick": (192, 6, 4096, 512),  # 3.6 M parameters, 0.04 GB
}
TARGETS = {
    "save_over_ceiling_min": 0.9,
    "async_blocking_over_copy_max": 1.2,
    "load_over_readinto_max": 1.3,
    "extra_rss_fraction_max": 0.10,
}


def _sync_file_range() -> Any:
    """Linux's sync_file_range (start writeback of a range now), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


# ---- the state --------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)


class GPT(nn.Module):
    """Only the parameters of a GPT (12 tensors per block); nothing here runs forward."""

    def __init__(self, dim: int, blocks: int, vocab: int, context: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(dim)


def build_state(shape: str, random: bool = True, shard: bool = False) -> tuple[GPT, Any]:
    """A GPT and an Adam optimizer whose state exists (as after the first step)."""
    with torch.device("meta"):
        model = GPT(*SHAPES[shape])
    model = model.to_empty(device="cpu")
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def fill(t: torch.Tensor) -> None:
        local = t.to_local() if hasattr(t, "to_local") else t
        if random:
            local.uniform_(-0.1, 0.1, generator=g)
        else:
            local.zero_()  # touches every page; values do not matter for a load

    with torch.no_grad():
        for p in model.parameters():
            fill(p)
            opt.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.empty_like(p),
                "exp_avg_sq": torch.empty_like(p),
            }
            fill(opt.state[p]["exp_avg"])
            fill(opt.state[p]["exp_avg_sq"])
    return model, opt


def registry_of(model: GPT, opt: Any) -> Registry:
    reg = Registry()
    reg.add("model", model)
    reg.add("optimizer", opt)
    return reg


def state_bytes(reg: Registry) -> int:
    return sum(_local(t).nbytes for t in reg.collect().tensors.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- save variants ----------------------------------------------------------------------------


class Saves:
    """Every save variant over one state; each call returns seconds (async: two figures)."""

    def __init__(self, model: GPT, opt: Any, reg: Registry, root: str) -> None:
        self.model, self.opt, self.reg, self.root = model, opt, reg, root
        self.nbytes = state_bytes(reg)
        self.step = 0
        self.sync_store = CheckpointStore(os.path.join(root, "sync"))
        self.async_store = CheckpointStore(os.path.join(root, "async"))
        self.saver = AsyncSaver(self.async_store)
        live = reg.collect().tensors
        self.copy_bufs = {k: torch.empty_like(v) for k, v in live.items()}
        for b in self.copy_bufs.values():
            b.zero_()  # touched: the floor is a copy into memory that is already mapped
        self.aligned = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self.aligned.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass  # no THP: the ceiling is then the 4 KiB one
        self.aligned.write(os.urandom(64 << 20))
        self.aligned_4k = mmap.mmap(-1, 64 << 20)  # shared: never a huge page (shmem THP off)
        self.aligned_4k.write(os.urandom(64 << 20))
        self.direct_fallback: str | None = None

    def _next(self) -> int:
        self.step += 1
        return self.step

    def unbroken_sync(self) -> float:
        step = self._next()
        t0 = time.perf_counter()
        path = self.sync_store.save(step, self.reg.collect(), {"epoch": 0, "samples": 0})
        dt = time.perf_counter() - t0
        shutil.rmtree(path)
        return dt

    def unbroken_async(self) -> tuple[float, float, float]:
        """(blocking as the caller sees it, the snapshot alone, total until committed)."""
        step = self._next()
        t0 = time.perf_counter()
        self.saver.save(step, self.reg.collect(), {"epoch": 0, "samples": 0})
        blocking = time.perf_counter() - t0
        self.saver.wait()
        total = time.perf_counter() - t0
        shutil.rmtree(os.path.join(self.async_store.root, f"step-{step:09d}"))
        return blocking, self.saver.last_blocking_seconds, total

    def torch_save(self) -> float:
        path = os.path.join(self.root, "state.pt")
        t0 = time.perf_counter()
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, path)
        fsync_path(path)
        fsync_path(self.root)
        dt = time.perf_counter() - t0
        os.remove(path)
        return dt

    def safetensors(self) -> float:
        path = os.path.join(self.root, "state.safetensors")
        t0 = time.perf_counter()
        save_file(self.reg.collect().tensors, path)
        fsync_path(path)
        fsync_path(self.root)
        dt = time.perf_counter() - t0
        os.remove(path)
        return dt

    def dcp(self) -> float:
        path = os.path.join(self.root, "dcp")
        t0 = time.perf_counter()
        writer = dcp.FileSystemWriter(path, sync_files=True)
        dcp.save(self.reg.collect().tensors, storage_writer=writer, no_dist=True)
        dt = time.perf_counter() - t0
        shutil.rmtree(path)
        return dt

    def ceiling_4k(self) -> float:
        return self.ceiling(self.aligned_4k)

    def ceiling(self, buf: mmap.mmap | None = None) -> float:
        path = os.path.join(self.root, "ceiling.bin")
        buf = self.aligned if buf is None else buf
        chunk = len(buf)
        total = -(-self.nbytes // 4096) * 4096
        view = memoryview(buf)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        direct = self.direct_fallback is None and hasattr(os, "O_DIRECT")
        t0 = time.perf_counter()
        try:
            fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
        except OSError as e:
            self.direct_fallback = f"O_DIRECT refused ({e.strerror}): plain write + fsync"
            return self.ceiling(buf)
        try:
            left = total
            while left > 0:
                left -= os.write(fd, view[: min(chunk, left)])
            os.fsync(fd)
        except OSError as e:
            if not direct:
                raise
            self.direct_fallback = f"O_DIRECT write failed ({e.strerror}): plain write + fsync"
            os.close(fd)
            return self.ceiling(buf)
        os.close(fd)
        dt = time.perf_counter() - t0
        os.remove(path)
        return dt

    def buffered(self) -> float:
        """The same bytes written through the page cache as fast as Python can: one
        ``write`` per tensor, writeback started every 32 MiB (``sync_file_range``), fsync."""
        path = os.path.join(self.root, "buffered.bin")
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            fd, done, flushed = f.fileno(), 0, 0
            for t in self.reg.collect().tensors.values():
                f.write(_bytes_view(t))
                done += t.nbytes
                if _SYNC_FILE_RANGE is not None and done - flushed >= (32 << 20):
                    _SYNC_FILE_RANGE(fd, flushed, 0, 2)  # SYNC_FILE_RANGE_WRITE
                    flushed = done
            os.fsync(fd)
        fsync_path(self.root)
        dt = time.perf_counter() - t0
        os.remove(path)
        return dt

    def copy_threads(self) -> float:
        """The same copy with torch's default intra-op threads."""
        t0 = time.perf_counter()
        for k, v in self.reg.collect().tensors.items():
            self.copy_bufs[k].copy_(v)
        return time.perf_counter() - t0

    def copy(self) -> float:
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            for k, v in self.reg.collect().tensors.items():
                self.copy_bufs[k].copy_(v)
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(n)


# ---- load variants ----------------------------------------------------------------------------

SAVE_ROWS = (
    "unbroken_sync",
    "async_blocking",
    "async_snapshot",
    "async_total",
    "torch_save",
    "safetensors",
    "dcp",
    "ceiling",
    "ceiling_4k",
    "buffered",
    "copy",
    "copy_threads",
)
LOADS = (
    "unbroken",
    "unbroken_twopass",
    "unbroken_noverify",
    "torch_load",
    "safetensors",
    "dcp",
    "readinto",
    "readinto_threads",
    "readinto_threads_xxh3",
)
COLD = ("unbroken", "safetensors", "readinto")


def write_fixtures(model: GPT, opt: Any, reg: Registry, root: str) -> dict[str, str]:
    """Every format's file(s) of the same state, once."""
    paths = {
        "unbroken": os.path.join(root, "ub"),
        "torch_load": os.path.join(root, "state.pt"),
        "safetensors": os.path.join(root, "state.safetensors"),
        "dcp": os.path.join(root, "dcp"),
        "readinto": os.path.join(root, "state.raw"),
    }
    CheckpointStore(paths["unbroken"]).save(1, reg.collect(), {"epoch": 0, "samples": 0})
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, paths["torch_load"])
    tensors = reg.collect().tensors
    save_file(tensors, paths["safetensors"])
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(paths["dcp"]), no_dist=True)
    with open(paths["readinto"], "wb") as f:
        for t in tensors.values():
            f.write(_bytes_view(t))
    with open(paths["readinto"] + ".json", "w") as f:
        json.dump(list(tensors), f)  # the order of the bytes (a restore may reorder dicts)
    paths["unbroken_noverify"] = paths["unbroken_twopass"] = paths["unbroken"]
    paths["readinto_threads"] = paths["readinto"]
    paths["readinto_threads_xxh3"] = paths["readinto"]
    return paths


def load_fn(kind: str, path: str, model: GPT, opt: Any, reg: Registry) -> Callable[[], None]:
    """One load of ``kind`` from ``path`` into the live tensors of ``model`` and ``opt``."""
    if kind in ("unbroken", "unbroken_twopass", "unbroken_noverify"):
        ckpt = os.path.join(path, "checkpoints", "step-000000001")

        def unbroken() -> None:
            reader = CheckpointReader(ckpt)
            # one pass: JSON files hashed, data files' sizes checked, chunks verified on read
            reader.verify(checksums=kind != "unbroken_noverify", data=kind == "unbroken_twopass")
            trees = {**reader.global_trees(), **(reader.local_trees(0) or {})}
            names = reg.check_names(trees)
            targets = reg.plan(names, trees, reader.tensor_infos())
            reader.load_tensors(targets, verify=kind == "unbroken")
            reg.restore(names, trees, targets)

        return unbroken
    if kind == "torch_load":

        def torch_load() -> None:
            sd = torch.load(path, mmap=True, weights_only=True)
            model.load_state_dict(sd["model"])
            live = opt.state_dict()["state"]
            with torch.no_grad():
                for i, st in sd["optimizer"]["state"].items():
                    for k, v in st.items():
                        live[i][k].copy_(v)

        return torch_load
    if kind == "safetensors":

        def safetensors() -> None:
            loaded = load_file(path)
            live = reg.collect().tensors
            with torch.no_grad():
                for k, v in loaded.items():
                    live[k].copy_(v)

        return safetensors
    if kind == "dcp":

        def stock_dcp() -> None:
            dcp.load(reg.collect().tensors, storage_reader=dcp.FileSystemReader(path), no_dist=True)

        return stock_dcp
    if kind == "readinto":
        with open(path + ".json") as f:
            order = json.load(f)

        def readinto() -> None:
            live = reg.collect().tensors
            with open(path, "rb", buffering=0) as f:
                for name in order:
                    view = _bytes_view(live[name])
                    if f.readinto(view) != len(view):
                        raise RuntimeError(f"{path} is truncated")

        return readinto
    if kind in ("readinto_threads", "readinto_threads_xxh3"):
        with open(path + ".json") as f:
            order = json.load(f)
        hashed = kind == "readinto_threads_xxh3"

        def readinto_threads() -> None:
            """``preadv`` into every live tensor, the tensors split between threads (as many
            as cores, at most 4), each taking the next tensor when free; ``_xxh3``: each
            1 MiB piece hashed right after it lands (the least a verified load must do)."""
            live = reg.collect().tensors
            jobs, off = [], 0
            for name in order:
                view = _bytes_view(live[name])
                jobs.append((view, off))
                off += len(view)
            fd = os.open(path, os.O_RDONLY)
            it = iter(jobs)
            lock = threading.Lock()

            def work() -> None:
                while True:
                    with lock:
                        job = next(it, None)
                    if job is None:
                        return
                    view, at = job
                    if not hashed:
                        if os.preadv(fd, [view], at) != len(view):
                            raise RuntimeError(f"{path} is truncated")
                        continue
                    h = xxhash.xxh3_64()
                    for a in range(0, len(view), 1 << 20):
                        piece = view[a : a + (1 << 20)]
                        if os.preadv(fd, [piece], at + a) != len(piece):
                            raise RuntimeError(f"{path} is truncated")
                        h.update(piece)

            n = max(1, min(4, len(os.sched_getaffinity(0))))
            threads = [threading.Thread(target=work) for _ in range(n - 1)]
            for t in threads:
                t.start()
            work()
            for t in threads:
                t.join()
            os.close(fd)

        return readinto_threads
    raise ValueError(kind)


def mem_child(kind: str, path: str, shape: str) -> None:
    """In a fresh process: build the live state, then report the peak RSS a load adds."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401  imports are not the load's

    model, opt = build_state(shape, random=False)
    reg = registry_of(model, opt)
    fn = load_fn(kind, path, model, opt, reg)
    before = peak_rss(reset=True)
    fn()
    after = peak_rss()
    print(json.dumps({"kind": kind, "state_bytes": state_bytes(reg), "extra": after - before}))


def peak_rss(reset: bool = False) -> int:
    """Peak resident bytes of this process; with ``reset``, first lower the peak to now.

    ``ru_maxrss`` cannot serve alone: Linux carries it over fork and exec, so a child of this
    (large) benchmark starts with the parent's peak. ``VmHWM`` belongs to the process's own
    memory map, and writing 5 to ``/proc/self/clear_refs`` resets it to the current RSS.
    """
    if reset:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_memory(paths: dict[str, str], shape: str) -> dict[str, float]:
    out = {}
    for kind in LOADS:
        cmd = [sys.executable, __file__, "--mem-child", kind, paths[kind], "--shape", shape]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"memory child {kind} failed:\n{proc.stderr[-3000:]}")
        rec = json.loads(proc.stdout.strip().splitlines()[-1])
        out[kind] = rec["extra"] / rec["state_bytes"]
    return out


# ---- world 1 vs 2 -----------------------------------------------------------------------------

WORLDS = ("w1", "w2_replicated", "w2_sharded")


def world_child(mode: str, run_dir: str, shape: str) -> None:
    """One rank of a world-size measurement: a warm-up save+load, then one timed of each."""
    import torch.distributed as dist

    from unbroken import _dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    model, opt = build_state(shape, random=True, shard=mode == "w2_sharded")
    reg = registry_of(model, opt)
    store = CheckpointStore(run_dir)
    rank = _dist.rank()

    def save(step: int) -> float:
        _dist.barrier()
        t0 = time.perf_counter()
        store.save(step, reg.collect(rank), {"epoch": 0, "samples": 0})
        _dist.barrier()
        return time.perf_counter() - t0

    def load(step: int) -> float:
        # As Run does it: rank 0 verifies (checksums), every rank opens and restores.
        _dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            store.open(step, checksums=True)
        step = _dist.broadcast_object(step)
        reader: CheckpointReader = store.open(step, checksums=False)
        trees = {**reader.global_trees(), **(reader.local_trees(rank) or {})}
        names = reg.check_names(trees)
        targets = reg.plan(names, trees, reader.tensor_infos())
        reader.load_tensors(targets)
        reg.restore(names, trees, targets)
        _dist.barrier()
        return time.perf_counter() - t0

    save(1)
    load(1)
    s, ld = save(2), load(2)
    if rank == 0:
        print(json.dumps({"mode": mode, "save": s, "load": ld, "bytes": state_bytes(reg) * world}))
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_world(mode: str, shape: str, root: str) -> dict[str, float]:
    world = 1 if mode == "w1" else 2
    run_dir = tempfile.mkdtemp(prefix=f"{mode}-", dir=root)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, __file__, "--world-child", mode, run_dir, "--shape", shape]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=900) for p in procs]
    shutil.rmtree(run_dir, ignore_errors=True)
    if any(p.returncode for p in procs):
        raise SystemExit(f"world {mode} failed:\n" + "\n".join(e[-3000:] for _, e in outs))
    return json.loads(outs[0][0].strip().splitlines()[-1])


# ---- main -------------------------------------------------------------------------------------


def drop_caches() -> bool:
    """Empty the page cache (root only); returns whether it could."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def rotated(items: list[str], r: int) -> list[str]:
    s = r % len(items)
    return items[s:] + items[:s]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a 0.09 GB state and 3 repeats")
    p.add_argument("--repeats", type=int, default=None, help="default 7 (3 with --quick)")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    p.add_argument("--skip-world", action="store_true", help="skip the world 1 vs 2 part")
    p.add_argument("--no-cold", action="store_true", help="skip the cold loads (need root)")
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mem-child", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world-child", nargs=2, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mem_child:
        mem_child(a.mem_child[0], a.mem_child[1], a.shape)
        return
    if a.world_child:
        world_child(a.world_child[0], a.world_child[1], a.shape)
        return
    repeats = a.repeats or (3 if a.quick else 7)
    shape = "quick" if a.quick else "full"
    wshape = "world-quick" if a.quick else "world"
    root = tempfile.mkdtemp(prefix="unbroken-bench-", dir=a.dir)
    try:
        run(a, repeats, shape, wshape, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(a: argparse.Namespace, repeats: int, shape: str, wshape: str, root: str) -> None:
    load_before = os.getloadavg()[0]
    model, opt = build_state(shape)
    reg = registry_of(model, opt)
    nbytes = state_bytes(reg)
    ntensors = len(reg.collect().tensors)
    print(
        f"state: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters + Adam, "
        f"{ntensors} tensors, {nbytes / 1e9:.3f} GB; writing under {root}",
        flush=True,
    )

    # -- save --
    saves = Saves(model, opt, reg, os.path.join(root, "save"))
    os.makedirs(saves.root)
    save_fns: dict[str, Callable[[], Any]] = {
        "unbroken_sync": saves.unbroken_sync,
        "unbroken_async": saves.unbroken_async,
        "torch_save": saves.torch_save,
        "safetensors": saves.safetensors,
        "dcp": saves.dcp,
        "ceiling": saves.ceiling,
        "ceiling_4k": saves.ceiling_4k,
        "buffered": saves.buffered,
        "copy": saves.copy,
        "copy_threads": saves.copy_threads,
    }
    keys = list(save_fns)
    for k in keys:  # warm-up: imports, first-touch of the async buffers
        save_fns[k]()
        os.sync()
    st: dict[str, list[float]] = {k: [] for k in keys if k != "unbroken_async"}
    st["async_blocking"], st["async_snapshot"], st["async_total"] = [], [], []
    for r in range(repeats):
        for k in rotated(keys, r):
            got = save_fns[k]()
            # Untimed: the file system is mounted with "discard" here, and the blocks a variant
            # freed would otherwise be discarded inside the next variant's fsync.
            os.sync()
            if k == "unbroken_async":
                st["async_blocking"].append(got[0])
                st["async_snapshot"].append(got[1])
                st["async_total"].append(got[2])
            else:
                st[k].append(got)
        print(f"save repeat {r + 1}/{repeats} done", flush=True)
    sm = {k: statistics.median(v) for k, v in st.items()}
    spread = {k: [round(min(v), 4), round(max(v), 4)] for k, v in st.items()}
    # How steady the disk was: the ceiling's own spread, and the save against the ceiling of
    # the same repeat (they run back to back, interleaved): a 0.9x read off medians means
    # little when the ceiling moves by a third between repeats.
    per_repeat = [c / s for c, s in zip(st["ceiling"], st["unbroken_sync"], strict=True)]
    spread["save_over_ceiling_per_repeat"] = [round(min(per_repeat), 3), round(max(per_repeat), 3)]
    spread["ceiling_relative_spread"] = [
        round((max(st["ceiling"]) - min(st["ceiling"])) / sm["ceiling"], 3),
        round(statistics.median(per_repeat), 3),
    ]

    # -- load --
    paths = write_fixtures(model, opt, reg, os.path.join(root, "load"))
    lfns = {k: load_fn(k, paths[k], model, opt, reg) for k in LOADS}
    for k in LOADS:  # warm-up: every file into the page cache
        lfns[k]()
    lt: dict[str, list[float]] = {k: [] for k in LOADS}
    lkeys = list(LOADS)
    for r in range(repeats):
        for k in rotated(lkeys, r):
            t0 = time.perf_counter()
            lfns[k]()
            lt[k].append(time.perf_counter() - t0)
        print(f"load repeat {r + 1}/{repeats} done", flush=True)
    lm = {k: statistics.median(v) for k, v in lt.items()}
    spread |= {f"load_{k}": [round(min(v), 4), round(max(v), 4)] for k, v in lt.items()}
    cold: dict[str, float] = {}
    if not a.no_cold and drop_caches():
        ct: dict[str, list[float]] = {k: [] for k in COLD}
        for r in range(repeats):
            for k in rotated(list(COLD), r):
                drop_caches()
                t0 = time.perf_counter()
                lfns[k]()
                ct[k].append(time.perf_counter() - t0)
            print(f"cold load repeat {r + 1}/{repeats} done", flush=True)
        cold = {k: statistics.median(v) for k, v in ct.items()}
        spread |= {f"cold_{k}": [round(min(v), 4), round(max(v), 4)] for k, v in ct.items()}
    del lfns
    mem = measure_memory(paths, shape)
    shutil.rmtree(os.path.join(root, "load"))
    fallback = saves.direct_fallback
    del saves, model, opt, reg

    # -- world 1 vs 2 --
    wm: dict[str, dict[str, float]] = {}
    wbytes = 0
    if not a.skip_world:
        wt: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in WORLDS}
        for r in range(repeats):
            for mode in rotated(list(WORLDS), r):
                rec = launch_world(mode, wshape, root)
                wbytes = int(rec["bytes"])
                wt[mode]["save"].append(rec["save"])
                wt[mode]["load"].append(rec["load"])
            print(f"world repeat {r + 1}/{repeats} done", flush=True)
        wm = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in wt.items()}
    load_after = os.getloadavg()[0]
    report(
        repeats=repeats,
        nbytes=nbytes,
        ntensors=ntensors,
        sm=sm,
        lm=lm,
        mem=mem,
        cold=cold,
        wm=wm,
        wbytes=wbytes,
        spread=spread,
        fallback=fallback,
        loads=(load_before, load_after),
    )


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


def report(
    *,
    repeats: int,
    nbytes: int,
    ntensors: int,
    sm: dict[str, float],
    lm: dict[str, float],
    mem: dict[str, float],
    cold: dict[str, float],
    wm: dict[str, dict[str, float]],
    wbytes: int,
    spread: dict[str, list[float]],
    fallback: str | None,
    loads: tuple[float, float],
) -> None:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    print()
    print(
        f"{when}; {os.cpu_count()} CPUs; load average {loads[0]:.2f} before, {loads[1]:.2f} "
        f"after; state {nbytes / 1e9:.3f} GB in {ntensors} tensors; {repeats} repeats, "
        "interleaved, medians"
    )
    print()
    ceiling = sm["ceiling"]
    ceiling_name = (
        "disk ceiling (O_DIRECT + fsync)" if fallback is None else (f"disk ceiling ({fallback})")
    )
    rows = [
        ("unbroken sync (durable, committed)", sm["unbroken_sync"]),
        ("unbroken async: blocking, as the caller sees it", sm["async_blocking"]),
        (
            "unbroken async: of which the snapshot (AsyncSaver.last_blocking_seconds)",
            sm["async_snapshot"],
        ),
        ("unbroken async: total (until committed)", sm["async_total"]),
        ("torch.save + fsync", sm["torch_save"]),
        ("safetensors save_file + fsync", sm["safetensors"]),
        ("DCP dcp.save (sync_files=True)", sm["dcp"]),
        (ceiling_name, ceiling),
        ("the same from a buffer of 4 KiB pages", sm["ceiling_4k"]),
        ("buffered write of the raw bytes + early writeback + fsync", sm["buffered"]),
        ("copy_ into preallocated buffers (1 thread)", sm["copy"]),
        ("copy_ into preallocated buffers (torch's default threads)", sm["copy_threads"]),
    ]
    print("| save | seconds (min..max) | GB/s | throughput vs ceiling |")
    print("| --- | ---: | ---: | ---: |")
    for (name, sec), key in zip(rows, SAVE_ROWS, strict=True):
        lo, hi = spread[key]
        print(
            f"| {name} | {sec:.3f} ({lo:.2f}..{hi:.2f}) | {gbps(nbytes, sec)} | "
            f"{ceiling / sec:.2f}x |"
        )
    print()
    floor = lm["readinto"]
    names = {
        "unbroken": "unbroken: verified load, one pass (checksums while reading)",
        "unbroken_twopass": "unbroken: checksum pass over the files, then load",
        "unbroken_noverify": "unbroken: load without checksums",
        "torch_load": "torch.load(mmap=True) + copy into live tensors",
        "safetensors": "safetensors load_file + copy into live tensors",
        "dcp": "DCP dcp.load into live tensors",
        "readinto": "readinto floor (raw bytes into live tensors)",
        "readinto_threads": "readinto floor in threads (preadv, tensors split between them)",
        "readinto_threads_xxh3": "the same, each 1 MiB hashed (xxh3) as it lands: verified floor",
    }
    print(
        "| load (warm page cache) | seconds (min..max) | GB/s | time vs readinto | peak extra RSS |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for k in LOADS:
        lo, hi = spread[f"load_{k}"]
        print(
            f"| {names[k]} | {lm[k]:.3f} ({lo:.2f}..{hi:.2f}) | {gbps(nbytes, lm[k])} | "
            f"{lm[k] / floor:.2f}x | {mem[k] * 100:.1f}% |"
        )
    print()
    if cold:
        print("| load (cold: page cache dropped first) | seconds (min..max) | GB/s | vs readinto |")
        print("| --- | ---: | ---: | ---: |")
        for k in COLD:
            lo, hi = spread[f"cold_{k}"]
            print(
                f"| {names[k]} | {cold[k]:.3f} ({lo:.2f}..{hi:.2f}) | {gbps(nbytes, cold[k])} | "
                f"{cold[k] / cold['readinto']:.2f}x |"
            )
        print()
    if wm:
        w1 = wm["w1"]
        print(
            f"| unbroken, {wbytes / 1e9:.2f} GB state | save s | load s | save vs w1 | load vs w1 |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
        wnames = {
            "w1": "world 1",
            "w2_replicated": "world 2, replicated (DDP-like)",
            "w2_sharded": "world 2, sharded (FSDP2)",
        }
        for m in WORLDS:
            d = wm[m]
            print(
                f"| {wnames[m]} | {d['save']:.3f} | {d['load']:.3f} | "
                f"{d['save'] / w1['save']:.2f}x | {d['load'] / w1['load']:.2f}x |"
            )
        print()
    ratios = {
        "save_over_ceiling": ceiling / sm["unbroken_sync"],
        "async_total_over_ceiling": ceiling / sm["async_total"],
        "save_over_buffered": sm["buffered"] / sm["unbroken_sync"],
        "save_over_safetensors": sm["safetensors"] / sm["unbroken_sync"],
        "load_over_safetensors": lm["unbroken"] / lm["safetensors"],
        "async_blocking_over_copy": sm["async_blocking"] / sm["copy"],
        "async_snapshot_over_copy": sm["async_snapshot"] / sm["copy"],
        "load_over_readinto": lm["unbroken"] / floor,
        "load_over_readinto_threads": lm["unbroken"] / lm["readinto_threads"],
        "load_over_verified_floor": lm["unbroken"] / lm["readinto_threads_xxh3"],
        "verified_floor_over_safetensors": lm["readinto_threads_xxh3"] / lm["safetensors"],
        "async_blocking_over_copy_threads": sm["async_blocking"] / sm["copy_threads"],
        "load_noverify_over_readinto": lm["unbroken_noverify"] / floor,
        "extra_rss_fraction": mem["unbroken"],
    }
    ok = {
        "save_over_ceiling": ratios["save_over_ceiling"] >= TARGETS["save_over_ceiling_min"],
        "save_faster_than_safetensors": ratios["save_over_safetensors"] > 1.0,
        "load_faster_than_safetensors": ratios["load_over_safetensors"] < 1.0,
        "async_blocking_over_copy": ratios["async_blocking_over_copy"]
        <= TARGETS["async_blocking_over_copy_max"],
        "load_over_readinto": ratios["load_over_readinto"] <= TARGETS["load_over_readinto_max"],
        "load_noverify_over_readinto": ratios["load_noverify_over_readinto"]
        <= TARGETS["load_over_readinto_max"],
        "extra_rss_fraction": ratios["extra_rss_fraction"] <= TARGETS["extra_rss_fraction_max"],
    }
    print("| target | measured | met |")
    print("| --- | ---: | --- |")
    print(
        f"| durable save throughput >= 0.9x the ceiling's | "
        f"{ratios['save_over_ceiling']:.2f}x | {ok['save_over_ceiling']} |"
    )
    lo, hi = spread["save_over_ceiling_per_repeat"]
    rel, med = spread["ceiling_relative_spread"]
    print(
        f"| (how steady: the ceiling {spread['ceiling'][0]:.3f}..{spread['ceiling'][1]:.3f} s, "
        f"a spread of {rel * 100:.0f}% of its median; save vs the ceiling of the same repeat "
        f"{med:.2f}x, {lo:.2f}..{hi:.2f}) | - | - |"
    )
    print(
        f"| durable save faster than safetensors + fsync (speed-up) | "
        f"{ratios['save_over_safetensors']:.2f}x | {ok['save_faster_than_safetensors']} |"
    )
    print(
        f"| verified load faster than safetensors + copy (time ratio) | "
        f"{ratios['load_over_safetensors']:.2f}x | {ok['load_faster_than_safetensors']} |"
    )
    print(
        f"| (the verified floor, threaded preadv + xxh3, against safetensors + copy) | "
        f"{ratios['verified_floor_over_safetensors']:.2f}x | - |"
    )
    print(
        f"| (unbroken's verified load against that floor) | "
        f"{ratios['load_over_verified_floor']:.2f}x | - |"
    )
    print(
        f"| async blocking <= 1.2x the copy floor | "
        f"{ratios['async_blocking_over_copy']:.2f}x | {ok['async_blocking_over_copy']} |"
    )
    print(
        f"| (for comparison: the snapshot alone vs the copy floor) | "
        f"{ratios['async_snapshot_over_copy']:.2f}x | - |"
    )
    print(
        f"| verified warm load (one pass) <= 1.3x readinto | "
        f"{ratios['load_over_readinto']:.2f}x | {ok['load_over_readinto']} |"
    )
    print(
        f"| (the same against the threaded readinto floor) | "
        f"{ratios['load_over_readinto_threads']:.2f}x | - |"
    )
    print(
        f"| (async blocking against the threaded copy_) | "
        f"{ratios['async_blocking_over_copy_threads']:.2f}x | - |"
    )
    print(
        f"| warm load <= 1.3x readinto (without checksums) | "
        f"{ratios['load_noverify_over_readinto']:.2f}x | {ok['load_noverify_over_readinto']} |"
    )
    print(
        f"| extra resident memory at load <= 10% of the state | "
        f"{ratios['extra_rss_fraction'] * 100:.1f}% | {ok['extra_rss_fraction']} |"
    )
    print()
    result: dict[str, Any] = {
        "bench": "checkpoint",
        "when": when,
        "cpus": os.cpu_count(),
        "load_average": [round(loads[0], 2), round(loads[1], 2)],
        "state_bytes": nbytes,
        "tensors": ntensors,
        "repeats": repeats,
        "ceiling": "O_DIRECT" if fallback is None else fallback,
        "save_s": {k: round(v, 4) for k, v in sm.items()},
        "load_s": {k: round(v, 4) for k, v in lm.items()},
        "load_extra_rss_fraction": {k: round(v, 4) for k, v in mem.items()},
        "cold_load_s": {k: round(v, 4) for k, v in cold.items()},
        "spread_s": spread,
        "world_state_bytes": wbytes,
        "world_s": {m: {k: round(v, 4) for k, v in d.items()} for m, d in wm.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "ceiling_spread": {
            "seconds": spread["ceiling"],
            "relative": spread["ceiling_relative_spread"][0],
            "save_over_ceiling_per_repeat": {
                "median": spread["ceiling_relative_spread"][1],
                "min_max": spread["save_over_ceiling_per_repeat"],
            },
        },
        "targets": TARGETS,
        "ok": ok,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
