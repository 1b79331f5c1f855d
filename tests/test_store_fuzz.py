"""Fuzzing the checkpoint reader: mutated real checkpoints give clean CheckpointErrors only.

Hypothesis mutates one file of a real format-2 checkpoint per example -- bytes flipped,
truncated, inserted, overwritten, or a JSON value anywhere in a JSON file replaced by another
(numbers at the edges, wrong types, deep nesting) -- and, most of the time, fixes up the
manifest's checksums so that the mutation reaches the parsers instead of stopping at the
checksum. Then it runs what a resume runs (verify, the content checks ``inspect`` shares with the
load, the restore into fresh objects) and allows only CheckpointError out. Each example has an
alarm (no hang); the peak resident memory of the whole run must stay under twice the checkpoint
size above what one clean restore takes.

UNBROKEN_FUZZ_EXAMPLES sets the number of examples (default 10000).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

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


def _load(d: str, rows: int) -> None:
    r = CheckpointReader(d)
    r.verify()
    r.check_contents()
    reg = _registry(1, rows)
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


mutation = st.one_of(
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


def _fuzz(d: str, files: dict[str, bytes], rows: int, inputs: int) -> dict[str, int]:
    seen = {"ok": 0, "refused": 0}
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
            signal.alarm(10)
            try:
                _load(d, rows)
                seen["ok"] += 1
            except (CheckpointError, StateError):  # StateError: components renamed or dropped
                seen["refused"] += 1
            finally:
                signal.alarm(0)

    try:
        one()
    finally:
        signal.signal(signal.SIGALRM, old)
        _restore_files(d, files)
        shutil.rmtree(os.path.dirname(os.path.dirname(os.path.dirname(d))), ignore_errors=True)
    return seen


def test_fuzzed_checkpoints_only_raise_checkpoint_errors():
    """EXAMPLES mutations of a small checkpoint (fast): clean errors only, no hang."""
    d, files = _pristine(rows=4)
    seen = _fuzz(d, files, 4, EXAMPLES)
    print(f"fuzz: {seen}")
    assert seen["ok"] + seen["refused"] >= EXAMPLES
    assert seen["refused"] > EXAMPLES // 2  # the mutations reach the checks


def test_fuzzed_checkpoints_stay_within_twice_their_size_in_memory():
    """The same mutations of a 16 MiB checkpoint: the peak resident memory grows by less than
    twice the checkpoint's size over the clean restore (which itself holds one copy)."""
    rows = 4096
    d, files = _pristine(rows)
    size = sum(len(b) for b in files.values())
    _load(d, rows)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seen = _fuzz(d, files, rows, max(200, EXAMPLES // 50))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(f"fuzz: {seen}; peak RSS grew {grown} bytes over a {size}-byte checkpoint")
    assert grown < 2 * size, (grown, size)
