"""The multi-threaded copy, hash and read paths (store/_par.py) and the cached ``tensors.json``.

``_par.MIN_BYTES`` (the size below which everything runs in the calling thread) is lowered to
0 so that a small state takes the threaded paths: the in-memory snapshot's copy into a slot,
the asynchronous save's copy into its buffers and the single-process load. Each must give the
very bytes of the one-thread path, in order, and a bad chunk must still be named.
"""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
import xxhash

from tests._store_helpers import assert_same, make_registry, restore, snapshot, train
from unbroken import CorruptCheckpointError
from unbroken.store import AsyncSaver, CheckpointReader, CheckpointStore, _format, _par, _storage
from unbroken.store._format import Chunk
from unbroken.store._manifest import dumps
from unbroken.store.snapshot._area import SnapshotArea


@pytest.fixture
def threaded(monkeypatch):
    monkeypatch.setattr(_par, "MIN_BYTES", 0)
    return _par.threads() > 1


def big_registry(seed: int = 0):
    """make_registry's state plus tensors large enough that each thread gets several."""
    reg = make_registry(seed)
    g = torch.Generator().manual_seed(5 + seed)
    extra = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1, 300_000, 7, 65_536, 1_000_003)
    )
    reg.add("extra", extra)
    return reg


def test_each_keeps_the_order_and_uses_the_threads(threaded):
    names: list[str] = []

    def work(i):
        names.append(threading.current_thread().name)
        return i * i

    assert _par.each(list(range(200)), work, nbytes=1) == [i * i for i in range(200)]
    assert threaded == ("unbroken-copy" in names)


def test_each_raises_the_first_error_after_every_thread_stopped(threaded):
    running = []

    def work(i):
        running.append(i)
        if i == 3:
            raise ValueError("item 3")
        return i

    with pytest.raises(ValueError, match="item 3"):
        _par.each(list(range(100)), work, nbytes=1)
    assert not [t for t in threading.enumerate() if t.name == "unbroken-copy"]
    assert len(running) < 100  # the other threads stopped taking items


def test_snapshot_async_save_and_load_are_exact_in_threads(tmp_path, threaded):
    reg = big_registry()
    train(reg, 2)
    want = snapshot(reg)
    area = SnapshotArea(str(tmp_path / "area"))
    area.save(2, reg.collect(), {"epoch": 0})
    saver = AsyncSaver(CheckpointStore(str(tmp_path / "async")))
    saver.save(2, reg.collect(), {"epoch": 0})
    saver.wait()
    train(reg, 1)  # the live state moves on; the checkpoints must not
    for root in (os.path.join(area.root), str(tmp_path / "async")):
        reader = CheckpointStore(root).latest()
        assert reader is not None and reader.step == 2
        reader.verify(checksums=True, data=True)
        assert_same(load_fresh(reader), want)  # a threaded verified load into fresh objects


def test_a_bad_chunk_is_named_by_the_threaded_load(tmp_path, threaded):
    reg = big_registry()
    store = CheckpointStore(str(tmp_path / "run"))
    path = store.save(1, reg.collect(), {"epoch": 0})
    reader = CheckpointReader(path)
    table = _storage.read_table(path, {n: r["size"] for n, r in reader.manifest["files"].items()})
    victim = max(table.values(), key=lambda e: e.chunks[0].nbytes).chunks[0]
    with open(os.path.join(path, victim.file), "r+b") as f:
        f.seek(victim.offset + victim.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match=victim.fqn.replace(".", r"\.")):
        load_fresh(CheckpointReader(path))


def load_fresh(reader: CheckpointReader):
    return restore(reader, big_registry)


def test_the_cached_table_is_exactly_the_json_of_its_document():
    rng = random.Random(0)
    names = ["a", "b.c", 'q"x', "ü/ß", '"xxh3_64":"0000000000000000"', "0" * 16]
    for _ in range(40):
        tensors, chunks, off = {}, [], 0
        for i in range(rng.randint(1, 12)):
            name = f"{rng.choice(names)}{i}"
            dtype = rng.choice([torch.float32, torch.int64, torch.bfloat16, torch.bool])
            t = torch.zeros(rng.randint(0, 4), rng.randint(1, 3), dtype=dtype)
            tensors[name] = t
            nbytes = t.numel() * t.element_size()
            chunks.append(
                Chunk(name, (0, 0), tuple(t.shape), "tensors-r00000.bin", off, nbytes, "")
            )
            off += -(-nbytes // 64) * 64
        for _ in range(3):  # the same layout again: the template, new checksums patched in
            chunks = [
                Chunk(c.fqn, c.offsets, c.sizes, c.file, c.offset, c.nbytes, _digest(rng))
                for c in chunks
            ]
            doc = _format.document(
                {c.fqn: _format.entry_doc(tensors[c.fqn].dtype, c.sizes, [c]) for c in chunks}
            )
            assert _storage.table_bytes(chunks, tensors) == dumps(doc)


def _digest(rng: random.Random) -> str:
    return xxhash.xxh3_64_hexdigest(rng.randbytes(8))
