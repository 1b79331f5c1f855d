"""Fuzzing the checkpoint reader: mutated real checkpoints give clean CheckpointErrors only.

Hypothesis mutates one file of a real format-2 checkpoint per example -- bytes flipped,
truncated, inserted, overwritten, a JSON value anywhere in a JSON file replaced by another
(numbers at the edges, wrong types, deep nesting), or the structure of tensors.json changed
(tests/_structural.py: a tensor split into any number of chunks or merged back, holes and
overlaps at any chunk count, the table inflated with extra entries) -- and, most of the time,
fixes up the manifest's checksums so that the mutation reaches the parsers instead of stopping
at the checksum. Then it runs what a resume runs (verify, the content checks ``inspect``
shares with the load, the restore) and allows only CheckpointError out. Each input has an
alarm (no hang); the peak resident memory while reading one must stay under twice the size of
the checkpoint (as mutated). At scale, a table of 10^5 chunks or entries: the same bounds, and
an exact split loads bit for bit.

UNBROKEN_FUZZ_EXAMPLES sets the number of examples (default 10000).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests import _structural
from tests._memory import peak, reset_peak
from tests._store_helpers import ckpt, refresh_manifest, write_manifest_raw
from unbroken import CheckpointError, StateError
from unbroken.state import Counters, Registry
from unbroken.store import CheckpointReader, CheckpointStore

EXAMPLES = int(os.environ.get("UNBROKEN_FUZZ_EXAMPLES", "10000"))
JSON_FILES = ("manifest.json", "tensors.json", "state.json", "rank-00000.json")
BIN = "tensors-r00000.bin"


def _registry(seed: int, rows: int) -> Registry:
    g = torch.Generator().manual_seed(seed)
    reg = Registry()
    box = torch.nn.Module()
    box.big = torch.nn.Parameter(torch.randn(rows, 1024, generator=g))
    box.small = torch.nn.Parameter(torch.randn(3, generator=g))
    box.register_buffer("count", torch.tensor([7], dtype=torch.int64))
    box.register_buffer("flags", torch.tensor([True, False]))
    reg.add("model", box)
    reg.add("counters", Counters())
    return reg


def _pristine(rows: int) -> tuple[str, dict[str, bytes]]:
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    run = os.path.join(root, "run")
    CheckpointStore(run).save(1, _registry(0, rows).collect(), {"epoch": 0, "samples": 0})
    d = ckpt(run, 1)
    files = {}
    for n in sorted(os.listdir(d)):
        with open(os.path.join(d, n), "rb") as f:
            files[n] = f.read()
    return d, files


def _load(d: str, reg: Registry) -> None:
    """What a resume runs, restoring into ``reg`` (made once: a fresh model per input would
    be the test's memory, not the reader's)."""
    r = CheckpointReader(d)
    r.verify()
    r.check_contents()
    trees = {**r.global_trees(), **(r.local_trees(0) or {})}
    names = reg.check_names(trees)
    targets = reg.plan(names, trees, r.tensor_infos())
    r.load_tensors(targets)
    reg.restore(names, trees, targets)


def _json_values() -> st.SearchStrategy[Any]:
    edge = st.sampled_from(
        [0, -1, 1, 2**31, 2**62, 2**63, 10**18, -(2**63), 0.5, 1e308, "", "x", None, True]
    )
    leaf = edge | st.integers() | st.text(max_size=8) | st.floats(allow_nan=False)
    return st.recursive(
        leaf,
        lambda kids: (
            st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3)
        ),
        max_leaves=6,
    )


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


# Chunk counts and entries around the edges that matter (one, a few, 64/65, many).
COUNTS = [1, 2, 3, 4, 5, 63, 64, 65, 255, 1000]
mutation = st.one_of(
    st.tuples(
        st.just("table"),
        st.sampled_from(_structural.KINDS),
        st.sampled_from(COUNTS),
        st.integers(0, 1 << 20),
        st.integers(0, 7).map(bool),  # fixed up 7 times in 8
    ),
    st.tuples(
        st.just("bytes"),
        st.sampled_from(sorted([*JSON_FILES, BIN])),
        st.sampled_from(["flip", "truncate", "insert", "overwrite"]),
        st.integers(0, 1 << 21),
        st.binary(min_size=1, max_size=16),
        st.booleans(),
    ),
    st.tuples(
        st.just("json"),
        st.sampled_from(JSON_FILES),
        st.integers(0, 1 << 16),
        _json_values(),
        st.booleans(),
        st.booleans(),
    ),
)


def _apply(d: str, files: dict[str, bytes], m: tuple) -> None:
    if m[0] == "table":
        _structural.apply(d, files, m)
        return
    if m[0] == "bytes":
        # In place, without copying the file (the memory test measures the reader, not this).
        _, name, op, pos, data, fix = m
        orig = memoryview(files[name])
        pos %= len(orig) + 1
        path = os.path.join(d, name)
        with open(path, "r+b") as f:
            if op == "flip" and len(orig):
                pos %= len(orig)
                f.seek(pos)
                f.write(bytes([orig[pos] ^ (1 << (data[0] % 8))]))
            elif op == "truncate":
                f.truncate(pos)
            elif op == "insert":
                f.seek(pos)
                f.write(data)
                f.write(orig[pos:])
            else:
                f.seek(pos)
                f.write(data)
        _fix(d, name, fix or name == BIN)
        return
    _, name, which, value, fix, _ = m
    doc = json.loads(files[name])
    paths = _paths(doc)
    doc = _replace(doc, paths[which % len(paths)], value)
    with open(os.path.join(d, name), "wb") as f:
        f.write(json.dumps(doc).encode())
    _fix(d, name, fix)


def _fix(d: str, name: str, fix: bool) -> None:
    if not fix:
        return
    if name == BIN:
        # The data file's checksum is its chunks' (kept); only its size is brought up to date,
        # so that the mutated bytes reach the per-chunk verification.
        m = json.loads(open(os.path.join(d, "manifest.json"), "rb").read())
        m["files"][BIN]["size"] = os.path.getsize(os.path.join(d, BIN))
        write_manifest_raw(d, m)
    elif name == "manifest.json":
        try:
            with open(os.path.join(d, name), "rb") as f:
                m = json.loads(f.read())
            if isinstance(m, dict):
                write_manifest_raw(d, m)  # a consistent self-checksum over the hostile fields
        except (ValueError, TypeError):
            pass
    else:
        try:
            refresh_manifest(d, name)
        except (ValueError, TypeError, KeyError, AttributeError):
            pass  # the manifest itself was mutated: nothing to fix up


def _restore_files(d: str, files: dict[str, bytes]) -> None:
    for n in os.listdir(d):
        if n not in files:
            os.remove(os.path.join(d, n))
    for n, raw in files.items():
        with open(os.path.join(d, n), "wb") as f:
            f.write(raw)


def _alarm(*_: object) -> None:
    raise TimeoutError("a fuzzed checkpoint made the reader hang")


PER_EXAMPLE = 10  # mutated inputs per Hypothesis example: its engine costs more than a load


def _fuzz(d: str, files: dict[str, bytes], rows: int, inputs: int, measure: bool = False) -> dict:
    """``inputs`` mutated inputs, each loaded; with ``measure``, how far the peak resident
    memory rose in any one load (measured from just before it: a peak over the whole run also
    caught the allocator's arenas and Hypothesis's engine, 21 MB in one process and 214 MB in
    the next on the same inputs), against the largest input checkpoint."""
    seen = {"ok": 0, "refused": 0, "grown": 0, "largest": 0}
    reg = _registry(1, rows)
    old = signal.signal(signal.SIGALRM, _alarm)

    @settings(
        max_examples=-(-inputs // PER_EXAMPLE),
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],  # no shrinking: a failure prints the example that failed
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(mutation, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    def one(ms: list[tuple]) -> None:
        for m in ms:
            _restore_files(d, files)
            _apply(d, files, m)
            ok, grown, size = _one(d, reg, measure=measure)
            seen["ok" if ok else "refused"] += 1
            seen["largest"] = max(seen["largest"], size)
            seen["grown"] = max(seen["grown"], grown)
            if m[0] == "table":  # exact layouts load, holes and overlaps never do
                assert ok == _structural.loads(m), m[:3]

    # Each measured load starts with a garbage collection; without this, every one walked the
    # whole heap of torch, Hypothesis and pytest (0.6 s each, 2/3 of the test's time).
    gc.collect()
    gc.freeze()
    try:
        one()
    finally:
        gc.unfreeze()
        signal.signal(signal.SIGALRM, old)
        _restore_files(d, files)
        shutil.rmtree(os.path.dirname(os.path.dirname(os.path.dirname(d))), ignore_errors=True)
    return seen


def _one(d: str, reg: Registry, measure: bool, alarm: int = 10) -> tuple[bool, int, int]:
    """Load the checkpoint ``d`` as it is now: (loaded, peak growth, its size)."""
    size = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))
    if measure:
        base = reset_peak()  # collects garbage first
    signal.alarm(alarm)
    try:
        _load(d, reg)
        ok = True
    except (CheckpointError, StateError):  # StateError: components renamed or dropped
        ok = False
    finally:
        signal.alarm(0)
    return ok, (peak() - base) if measure else 0, size


def test_fuzzed_checkpoints_only_raise_checkpoint_errors():
    """EXAMPLES mutations of a small checkpoint (fast): clean errors only, no hang."""
    d, files = _pristine(rows=4)
    seen = _fuzz(d, files, 4, EXAMPLES)
    print(f"fuzz: {seen}")
    assert seen["ok"] + seen["refused"] >= EXAMPLES
    assert seen["refused"] > EXAMPLES // 2  # the mutations reach the checks
    assert seen["ok"] > EXAMPLES // 100  # ... and exact splits and merges load


def test_fuzzed_checkpoints_stay_within_twice_their_size_in_memory():
    """The same mutations of a 16 MiB checkpoint: over all of them, the peak resident memory
    rises by less than twice the checkpoint's size (the restore is in place, into one model)."""
    rows = 4096
    d, files = _pristine(rows)
    seen = _fuzz(d, files, rows, max(200, EXAMPLES // 50), measure=True)
    print(f"fuzz: {seen}")
    assert seen["grown"] < 2 * seen["largest"], seen


SCALE = [
    ("table", "split", 100_000, 0, True),
    ("table", "hole-and-overlap", 100_000, 54_321, True),
    ("table", "inflate-empty", 100_000, 0, True),
    ("table", "inflate-alias", 100_000, 0, True),
]


def test_tables_of_100000_chunks_or_entries():
    """The 16 MiB checkpoint's big tensor split into 10^5 chunks (loads bit for bit) or with a
    hole and an overlap among them, its table inflated by 10^5 entries (empty tensors: refused
    early; tiny ones aliasing the data: refused): clean errors, no hang, under twice the
    mutated checkpoint's size in memory."""
    rows = 4096
    d, files = _pristine(rows)
    want = _registry(0, rows).get("model").big.detach().clone()
    reg = _registry(1, rows)
    try:
        for m in SCALE:
            loads = _structural.loads(m)
            _restore_files(d, files)
            _apply(d, files, m)
            with torch.no_grad():
                reg.get("model").big.zero_()
            ok, grown, size = _one(d, reg, measure=True, alarm=120)
            print(f"{m[1]} x{m[2]}: {'loaded' if ok else 'refused'}, grew {grown} over {size}")
            assert ok == loads, m
            assert grown < 2 * size, (m, grown, size)
            if loads:
                assert torch.equal(reg.get("model").big, want)
    finally:
        shutil.rmtree(os.path.dirname(os.path.dirname(os.path.dirname(d))), ignore_errors=True)
