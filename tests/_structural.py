"""Structural mutations of a real checkpoint's tensors.json, for the fuzz test: the big
tensor split into any number of chunks (each with the right checksum, so that an exact split
loads bit for bit), chunks merged back, holes and overlaps at any chunk count, and the table
inflated by up to 10^5 entries (empty tensors, tiny tensors aliasing the data, tiny tensors
past its end). The manifest is fixed up (when ``fix``) so that the table reaches its parser.

A mutation is ``("table", kind, n, k, fix)``: ``n`` chunks or entries, ``k`` where the fault
goes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import xxhash

from unbroken.store import _format

from ._store_helpers import read_manifest_raw, write_manifest_raw

BIG = "model/big"
BIN = "tensors-r00000.bin"
KINDS = (
    "split",
    "merge",
    "hole-and-overlap",
    "twice",
    "drop",
    "inflate-empty",
    "inflate-alias",
    "inflate-past",
)
MAX_EMPTY_TENSORS = 1 << 16  # docs/checkpoint-format.md


def loads(m: tuple) -> bool:
    """Whether the mutation ``m`` leaves a checkpoint that must load: an exact split or merge,
    or empty tensors added within the bound, all fixed up; every other one must be refused."""
    _, kind, n, _, fix = m
    valid = kind in ("split", "merge") or (kind == "inflate-empty" and n <= MAX_EMPTY_TENSORS)
    return bool(fix) and valid


def _chunk(data: bytes, offsets: list[int], sizes: list[int], offset: int, nbytes: int) -> dict:
    return {
        "offsets": offsets,
        "sizes": sizes,
        "file": BIN,
        "offset": offset,
        "nbytes": nbytes,
        "xxh3_64": xxhash.xxh3_64_hexdigest(data[offset : offset + nbytes]),
    }


def split(table: dict[str, Any], data: bytes, n: int) -> list[dict]:
    """The big float32 [rows, 1024] tensor in about ``n`` chunks whose bytes are where the
    whole tensor's are: row bands, or (past one chunk a row) rows cut into column blocks of a
    multiple of 16 elements (64-byte aligned)."""
    spec = table["tensors"][BIG]
    rows, cols = spec["shape"]
    base = spec["chunks"][0]["offset"]
    row_bytes = cols * 4
    if n <= rows:
        edges = [rows * i // n for i in range(n + 1)]
        return [
            _chunk(data, [a, 0], [b - a, cols], base + a * row_bytes, (b - a) * row_bytes)
            for a, b in zip(edges, edges[1:], strict=False)
            if b > a
        ]
    blocks = min(cols // 16, -(-n // rows))
    col_edges = [16 * ((cols // 16) * j // blocks) for j in range(blocks + 1)]
    return [
        _chunk(data, [r, a], [1, b - a], base + r * row_bytes + a * 4, (b - a) * 4)
        for r in range(rows)
        for a, b in zip(col_edges, col_edges[1:], strict=False)
    ]


def _merge(chunks: list[dict], k: int, data: bytes) -> list[dict]:
    """Chunks k and k+1 as one, where their union is a box whose bytes are contiguous."""
    if len(chunks) < 2:
        return chunks
    k %= len(chunks) - 1
    a, b = chunks[k], chunks[k + 1]
    rows_a, rows_b = a["sizes"][0], b["sizes"][0]
    same_row = rows_a == rows_b == 1 and a["offsets"][0] == b["offsets"][0]
    bands = a["sizes"][1] == b["sizes"][1] and a["offsets"][1] == b["offsets"][1] == 0
    if not (same_row or bands) or a["offset"] + a["nbytes"] != b["offset"]:
        return chunks
    if same_row:
        sizes = [1, a["sizes"][1] + b["sizes"][1]]
    else:
        sizes = [rows_a + rows_b, a["sizes"][1]]
    merged = _chunk(data, a["offsets"], sizes, a["offset"], a["nbytes"] + b["nbytes"])
    return [*chunks[:k], merged, *chunks[k + 2 :]]


def _fault(kind: str, chunks: list[dict], k: int, shape: list[int]) -> list[dict]:
    k %= len(chunks)
    out = [dict(c) for c in chunks]
    if kind == "drop" or (kind == "twice" and len(out) == 1):
        del out[k]  # a hole
    elif kind == "twice":
        out[k] = dict(out[(k + 1) % len(out)])  # one chunk twice, another missing
    else:  # hole-and-overlap: the element counts still add up
        c = out[k]
        dim = 0 if c["sizes"][0] < shape[0] else 1
        step = 1 if dim == 0 else 16
        moved = list(c["offsets"])
        moved[dim] += step if moved[dim] + c["sizes"][dim] + step <= shape[dim] else -step
        c["offsets"] = moved
    return out


def _inflate(kind: str, table: dict[str, Any], n: int, size: int) -> None:
    tensors = table["tensors"]
    empty = xxhash.xxh3_64_hexdigest(b"")
    for i in range(n):
        if kind == "inflate-empty":
            chunk = {"offsets": [0], "sizes": [0], "offset": 0, "nbytes": 0, "xxh3_64": empty}
            shape = [0]
        else:  # aliasing the data that is there, or past the end of the file
            at = 64 * i if kind == "inflate-alias" else size + 64 * i
            chunk = {"offsets": [0], "sizes": [1], "offset": at, "nbytes": 1, "xxh3_64": empty}
            shape = [1]
        tensors[f"model/extra{i}"] = {
            "dtype": "uint8",
            "shape": shape,
            "chunks": [{**chunk, "file": BIN}],
        }


def apply(d: str, files: dict[str, bytes], m: tuple) -> None:
    """Write the mutated tensors.json into the checkpoint ``d`` (pristine ``files``)."""
    _, kind, n, k, fix = m
    table = json.loads(files[_format.TABLE_FILE])
    data = files[BIN]
    shape = table["tensors"][BIG]["shape"]
    if kind.startswith("inflate"):
        _inflate(kind, table, n, len(data))
    else:
        chunks = split(table, data, n)
        if kind == "merge":
            chunks = _merge(chunks, k, data)
        elif kind != "split":
            chunks = _fault(kind, chunks, k, shape)
        table["tensors"][BIG]["chunks"] = chunks
    raw = json.dumps(table).encode()
    with open(os.path.join(d, _format.TABLE_FILE), "wb") as f:
        f.write(raw)
    if not fix:
        return
    manifest = read_manifest_raw(d)
    placed = sorted(  # the writer's order: by offset, empty chunks first (unbroken/store/_table.py)
        (c["offset"], c["nbytes"] > 0, c["xxh3_64"])
        for spec in table["tensors"].values()
        for c in spec["chunks"]
        if c["file"] == BIN
    )
    manifest["files"][BIN]["xxh3_64"] = _format.combine([h for _, _, h in placed])
    manifest["files"][_format.TABLE_FILE] = {
        "size": len(raw),
        "xxh3_64": xxhash.xxh3_64_hexdigest(raw),
    }
    write_manifest_raw(d, manifest)
