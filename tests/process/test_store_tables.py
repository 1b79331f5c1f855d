"""Crafted tensor tables (tensors.json), every checksum right: the chunks of a tensor must cover
it exactly once whatever their number, and no table costs more than its size allows.

Each checkpoint here is written byte by byte (tests/_crafted.py), so that the crafted layout
reaches the table's validation; then the checks a resume and ``inspect`` run are run on it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import _crafted
from unbroken import CorruptCheckpointError
from unbroken.cli import main
from unbroken.state import Registry
from unbroken.store import CheckpointReader, CheckpointStore


def _restored(reader: CheckpointReader, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load ``reader`` into a fresh module whose buffers have the shapes of ``like`` (filled
    with -1, so that an element no chunk covers would show)."""
    box = torch.nn.Module()
    for name, t in like.items():
        box.register_buffer(name, torch.full_like(t, -1))
    reg = Registry()
    reg.add("model", box)
    reader.verify()
    reader.check_contents()
    trees = reader.global_trees()
    names = reg.check_names(trees)
    targets = reg.plan(names, trees, reader.tensor_infos())
    reader.load_tensors(targets)
    reg.restore(names, trees, targets)
    return {n: b.clone() for n, b in box.named_buffers()}


def _refused(d: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(CorruptCheckpointError) as e:
        CheckpointReader(d).verify()
    # What a resume does: no checkpoint of the run loads, so it refuses to start over.
    with pytest.raises(CorruptCheckpointError):
        CheckpointStore(os.path.dirname(os.path.dirname(d))).latest()
    assert main(["inspect", d]) == 1
    capsys.readouterr()
    return str(e.value)


def test_the_issue_case_65_chunks_a_hole_and_an_overlap(tmp_path: Path, capsys) -> None:
    """float32[66] in 65 chunks: element 5 in none, element 11 in two (the counts add up)."""
    x = torch.arange(66, dtype=torch.float32)
    boxes = [((0,), (2,)), ((2,), (1,)), ((3,), (1,)), ((4,), (1,))]
    boxes += [((i,), (1,)) for i in range(6, 66)] + [((11,), (1,))]
    assert len(boxes) == 65 and sum(s[0] for _, s in boxes) == 66
    d = _crafted.run_dir_with(str(tmp_path / "run"), {"model/x": (x, boxes)})
    assert "do not cover it exactly once" in _refused(d, capsys)


@pytest.mark.parametrize("n", [1, 2, 64, 65, 1000, 100_000])
def test_any_chunk_count_is_checked_exactly(tmp_path: Path, capsys, n: int) -> None:
    """One tensor in n chunks: the exact split loads bit for bit; the same split with one
    boundary moved (a hole beside an overlap) or one chunk twice is refused."""
    x = torch.randn(n + 3, generator=torch.Generator().manual_seed(n))
    good = _crafted.grid(x.shape, [n])
    d = _crafted.run_dir_with(str(tmp_path / "good"), {"model/x": (x, good)})
    got = _restored(CheckpointReader(d), {"x": x})
    assert torch.equal(got["x"], x)
    if n == 1:
        bad = [((1,), (n + 2,))]  # element 0 in no chunk; the sizes do not add up either
    else:
        # Chunk k-1 moved one element on: a hole at its old start and an overlap with chunk
        # k at its new end; the element counts still add up.
        k = n // 2
        (o0, s0) = good[k - 1]
        bad = list(good)
        bad[k - 1] = ((o0[0] + 1,), s0)
    d = _crafted.run_dir_with(str(tmp_path / "bad"), {"model/x": (x, bad)})
    _refused(d, capsys)
    twice = [*good[:-1], good[0]]  # the last chunk replaced by a copy of the first
    if len(good) > 1:
        d = _crafted.run_dir_with(str(tmp_path / "twice"), {"model/x": (x, twice)})
        _refused(d, capsys)


def test_two_dimensional_layouts(tmp_path: Path, capsys) -> None:
    x = torch.randn(12, 10, generator=torch.Generator().manual_seed(0))
    # A grid of 120 chunks (past any small-count shortcut), and a brick wall: each row band
    # split at other columns (not a grid, still an exact cover).
    g = _crafted.grid(x.shape, [12, 10])
    bricks = [((r, c), (3, w)) for r in (0, 6) for c, w in ((0, 4), (4, 6))]
    bricks += [((r, c), (3, w)) for r in (3, 9) for c, w in ((0, 7), (7, 3))]
    for name, boxes in (("grid", g), ("bricks", bricks)):
        d = _crafted.run_dir_with(str(tmp_path / name), {"model/x": (x, boxes)})
        assert torch.equal(_restored(CheckpointReader(d), {"x": x})["x"], x)
    # One cell of the grid missing and another cell twice; a brick shifted by one column.
    holes = [b for b in g if b != ((5, 5), (1, 1))] + [((7, 2), (1, 1))]
    shifted = [((0, 1), (3, 4)) if b == ((0, 0), (3, 4)) else b for b in bricks]
    shifted = [((0, 0), (3, 1)) if b == ((0, 4), (3, 6)) else b for b in shifted]
    for name, boxes in (("holes", holes), ("shifted", shifted)):
        d = _crafted.run_dir_with(str(tmp_path / name), {"model/x": (x, boxes)})
        assert "do not cover it exactly once" in _refused(d, capsys), name


def test_an_empty_tensor_beside_a_full_one_verifies(tmp_path: Path) -> None:
    """An empty buffer saved right before a full one shares its offset; the data file's
    checksum combines the chunks in the order they were written (the empty one first),
    whatever order their names sort in. Before, a model with an empty buffer named after a
    full one wrote checkpoints that never verified."""
    box = torch.nn.Module()
    box.register_buffer("z", torch.empty(0))
    box.register_buffer("b", torch.arange(3.0))
    reg = Registry()
    reg.add("model", box)
    store = CheckpointStore(str(tmp_path / "run"))
    store.save(1, reg.collect(), {})
    reader = store.latest()
    assert reader is not None and reader.step == 1
    got = _restored(reader, {"z": torch.empty(0), "b": torch.zeros(3)})
    assert torch.equal(got["b"], torch.arange(3.0))


def test_empty_tensors_and_empty_chunks(tmp_path: Path) -> None:
    """A tensor with no elements, and empty chunks beside full ones (a rank whose shard of an
    uneven split is empty), are valid."""
    e = torch.empty(4, 0)
    y = torch.arange(6.0)
    tensors = {
        "model/e": (e, [((0, 0), (4, 0))]),
        "model/y": (y, [((0,), (6,)), ((6,), (0,))]),
    }
    d = _crafted.run_dir_with(str(tmp_path / "run"), tensors)
    got = _restored(CheckpointReader(d), {"e": e, "y": y})
    assert got["e"].shape == (4, 0) and torch.equal(got["y"], y)


# ---- bounded cost -------------------------------------------------------------------------------

COST = Path(__file__).parent.parent / "scripts" / "table_cost.py"
TINY = 100_000


def _tiny_tensors(run: Path, n: int, referenced: int) -> int:
    """A checkpoint of ``n`` one-byte tensors plus a weight (every checksum right), whose
    state refers to ``referenced`` of them: the issue's table of tiny tensors, or (few
    referenced) a table inflated beside a small state. Returns the checkpoint's size."""
    tensors: dict[str, tuple[torch.Tensor, list[_crafted.Box]]] = {
        "model/w": (torch.arange(16.0), [((0,), (16,))])
    }
    one = [((0,), (1,))]
    for i in range(n):
        tensors[f"model/t{i}"] = (torch.tensor([i % 251], dtype=torch.uint8), one)
    d = str(run / "checkpoints" / "step-000000001")
    _crafted.write(d, tensors, referenced=["model/w", *[f"model/t{i}" for i in range(referenced)]])
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d))


def _cost(warmup: Path, run: Path, op: str) -> dict:
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(COST.parent.parent.parent)}
    proc = subprocess.run(
        [sys.executable, str(COST), str(warmup), str(run), op],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, n, refs in (("warmup", 10, 10), ("all", TINY, TINY), ("inflated", TINY, 10)):
        out[name] = (root / name, _tiny_tensors(root / name, n, refs))
    return out


def test_a_table_of_many_tiny_tensors_costs_less_than_twice_its_checkpoint(tiny) -> None:
    """100,000 one-byte tensors, every one in the state (a legitimate, if odd, checkpoint):
    ``ls`` -- which verifies every file and chunk -- peaks below twice the checkpoint's size in
    memory (the table's JSON is most of it). (Restoring it also parses a state of 100,000
    entries into dicts, about ten times that file's size: the state's cost, not the table's.)"""
    (warmup, _), (run, size) = tiny["warmup"], tiny["all"]
    got = _cost(warmup, run, "ls")
    assert got["outcome"].startswith("exit 0"), got
    assert got["grown"] < 2 * size, (got, size)


@pytest.mark.parametrize("op", ["resume", "read", "ls", "inspect", "inspect-json"])
def test_an_inflated_table_costs_less_than_twice_its_checkpoint(tiny, op) -> None:
    """A table inflated to 100,000 entries beside a state that names ten of them: a resume,
    what ``inspect`` reads, ``ls`` and ``inspect`` itself -- which shows every tensor of the
    table, as a table or as JSON -- each peak below twice the checkpoint's size (``inspect``
    built a Python row per tensor, then every line: 3-6x)."""
    (warmup, _), (run, size) = tiny["warmup"], tiny["inflated"]
    got = _cost(warmup, run, op)
    assert not got["outcome"].startswith("refused"), got
    assert got["grown"] < 2 * size, (got, size)


# ---- bounds, refused before the rest is read ----------------------------------------------------


def _with_table(tmp_path: Path, text: str, data_bytes: int) -> str:
    """A checkpoint whose data file has ``data_bytes`` zero bytes and whose tensors.json is
    ``text`` (the manifest made to match both)."""
    from tests._store_helpers import refresh_manifest

    d = _crafted.run_dir_with(str(tmp_path / "run"), {"model/x": (torch.zeros(1), [((0,), (1,))])})
    with open(os.path.join(d, "tensors-r00000.bin"), "wb") as f:
        f.write(bytes(data_bytes))
    with open(os.path.join(d, "tensors.json"), "w") as f:
        f.write(text)
    refresh_manifest(d, "tensors-r00000.bin", "tensors.json")
    return d


def _chunk(offset: int, nbytes: int, start: int = 0, file: str = "tensors-r00000.bin") -> str:
    digest = "0" * 16
    return (
        f'{{"file":"{file}","nbytes":{nbytes},"offset":{offset},"offsets":[{start}],'
        f'"sizes":[{nbytes}],"xxh3_64":"{digest}"}}'
    )


GARBAGE = ", this is where a reader that read on would fail"


def _refusal(d: str) -> str:
    with pytest.raises(CorruptCheckpointError) as e:
        CheckpointReader(d).verify(checksums=False)
    return str(e.value)


def test_more_chunks_than_the_data_files_hold_are_refused_early(tmp_path: Path) -> None:
    """1,000 slots of 64 bytes in the data file, 1,001 one-byte chunks claimed: refused at the
    1,001st, before the rest of the table (here: not JSON) is read."""
    chunks = [_chunk(64 * i, 1, start=i) for i in range(1000)] + [_chunk(0, 1, start=1000)]
    text = '{"format":"unbroken-tensors","tensors":{"model/x":{"chunks":[' + ",".join(chunks)
    d = _with_table(tmp_path, text + GARBAGE, 64 * 1000)
    assert "more chunks than its data files can hold" in _refusal(d)


def test_too_many_tensors_without_elements_are_refused_early(tmp_path: Path) -> None:
    empty = '{"chunks":[' + _chunk(0, 0) + '],"dtype":"uint8","shape":[0]}'
    n = 65_537
    body = ",".join(f'"model/e{i}":{empty}' for i in range(n))
    text = '{"format":"unbroken-tensors","tensors":{' + body
    d = _with_table(tmp_path, text + GARBAGE, 64)
    assert "more than 65536 tensors without elements" in _refusal(d)


@pytest.mark.parametrize(
    "chunks, words",
    [
        ([_chunk(0, 4, 0), _chunk(0, 0, 4)] + [_chunk(0, 0, 4)] * 8, "chunks without elements"),
        ([_chunk(0, 4, file="state.json")], "not a data file"),
        ([_chunk(32, 4)], "not a multiple of 64"),
    ],
    ids=["empty-chunks-past-one-per-file", "chunk-in-state-json", "unaligned"],
)
def test_chunks_outside_the_format_are_refused(tmp_path: Path, chunks, words) -> None:
    spec = '{"chunks":[' + ",".join(chunks) + '],"dtype":"uint8","shape":[4]}'
    text = '{"format":"unbroken-tensors","tensors":{"model/x":' + spec + '},"version":2}'
    d = _with_table(tmp_path, text, 128)
    assert words in _refusal(d)


def test_coverage_agrees_with_counting_every_element() -> None:
    """The coverage check against the plain count of chunks per element, on 3000 layouts of
    1-3 dimensions: guillotine cuts (exact, also brick-like), then half of them damaged -- a
    chunk shifted by one, one chunk twice, one dropped."""
    import random

    import numpy as np

    from unbroken.store._cover import covers

    rng = random.Random(27)

    def cut(lo: list[int], size: list[int], depth: int) -> list[tuple[list[int], list[int]]]:
        k = rng.randrange(len(size))
        if depth == 0 or rng.random() < 0.3 or size[k] < 2:
            return [(lo, size)]
        c = rng.randrange(1, size[k])
        a, b_lo, b = list(size), list(lo), list(size)
        a[k], b_lo[k], b[k] = c, lo[k] + c, size[k] - c
        return cut(lo, a, depth - 1) + cut(b_lo, b, depth - 1)

    verdicts = []
    for _ in range(3000):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.choice([1, 2, 3])))
        boxes = cut([0] * len(shape), list(shape), 6)
        if rng.random() < 0.5 and len(boxes) > 1:
            i, k = rng.randrange(len(boxes)), rng.randrange(len(shape))
            lo, size = list(boxes[i][0]), boxes[i][1]
            op = rng.choice(["shift", "twice", "drop"])
            if op == "shift" and lo[k] + size[k] < shape[k]:
                lo[k] += 1
                boxes[i] = (lo, size)
            elif op == "twice":
                boxes[i] = boxes[(i + 1) % len(boxes)]
            else:
                boxes.pop(i)
        count = np.zeros(shape, dtype=np.int64)
        for lo, size in boxes:
            count[tuple(slice(o, o + n) for o, n in zip(lo, size, strict=True))] += 1
        want = bool((count == 1).all())
        arr = np.array(boxes, dtype=np.int64).reshape(len(boxes), 2, len(shape))
        assert covers(shape, arr[:, 0], arr[:, 1], "t") == want, (shape, boxes)
        verdicts.append(want)
    assert 500 < sum(verdicts) < 2500  # both kinds, many of each


def test_the_torch_free_dtype_names_are_torchs() -> None:
    """A table is validated from dtype names and their sizes (store/_format.DTYPE_ITEMSIZE), so
    that listing a run directory imports no torch; each name is torch's dtype of that size."""
    from unbroken.store import _format

    for name, size in _format.DTYPE_ITEMSIZE.items():
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}"
        assert dtype.itemsize == size, name
    assert list(_format.DTYPES) == list(_format.DTYPE_ITEMSIZE)
    assert _format.DTYPE_NAMES == {d: n for n, d in _format.DTYPES.items()}
