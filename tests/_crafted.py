"""Crafting format-2 checkpoints byte by byte: any chunk layout of any tensor, every checksum
right, so that what a test plants reaches the table's validation (not the checksums)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import xxhash

from unbroken.store import _format, _layout, _manifest

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes) of a chunk


def grid(shape: Sequence[int], pieces: Sequence[int]) -> list[Box]:
    """``shape`` cut into ``pieces[d]`` (nearly) equal parts along each dimension d."""
    cuts = []
    for n, p in zip(shape, pieces, strict=True):
        edges = [n * i // p for i in range(p + 1)]
        cuts.append([(a, b - a) for a, b in zip(edges, edges[1:], strict=False)])
    boxes: list[Box] = [((), ())]
    for axis in cuts:
        boxes = [((*o, a), (*s, n)) for o, s in boxes for a, n in axis]
    return boxes


def write(
    ckpt_dir: str,
    tensors: dict[str, tuple[torch.Tensor, Iterable[Box]]],
    *,
    referenced: Iterable[str] | None = None,
    step: int = 1,
) -> None:
    """A committed-looking checkpoint directory holding ``tensors`` (fqn -> (full value, its
    chunks)) in one data file, each chunk's bytes at a 64-byte-aligned offset; state.json's
    component ``model`` refers to the tensors named in ``referenced`` (default: all), by the
    name after ``model/``."""
    os.makedirs(ckpt_dir, exist_ok=True)
    data = bytearray()
    doc: dict[str, Any] = {}
    digests = []
    for fqn, (full, boxes) in tensors.items():
        chunks = []
        for offsets, sizes in boxes:
            part = full
            for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
                part = part.narrow(dim, o, n)
            raw = part.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            start = -(-len(data) // _format.ALIGN) * _format.ALIGN
            data.extend(bytes(start - len(data)))
            data.extend(raw)
            digest = xxhash.xxh3_64_hexdigest(raw)
            digests.append((start, digest))
            chunks.append(
                {
                    "offsets": list(offsets),
                    "sizes": list(sizes),
                    "file": _format.data_file(0),
                    "offset": start,
                    "nbytes": len(raw),
                    "xxh3_64": digest,
                }
            )
        doc[fqn] = {
            "dtype": _format.DTYPE_NAMES[full.dtype],
            "shape": list(full.shape),
            "chunks": chunks,
        }
    names = list(tensors) if referenced is None else list(referenced)
    state = {
        "components": {"model": {n.split("/", 1)[1]: {"$tensor": n} for n in names}},
    }
    files: dict[str, dict[str, Any]] = {}

    def put(name: str, raw: bytes, digest: str | None = None) -> None:
        with open(os.path.join(ckpt_dir, name), "wb") as f:
            f.write(raw)
        files[name] = {"size": len(raw), "xxh3_64": digest or xxhash.xxh3_64_hexdigest(raw)}

    file_digest = _format.combine([d for _, d in sorted(digests)])
    put(_format.data_file(0), bytes(data), file_digest)
    put(_format.TABLE_FILE, _manifest.dumps(_format.document(doc)))
    put(_manifest.STATE_FILE, _manifest.dumps(state))
    put(_manifest.rank_file(0), _manifest.dumps({"components": {}}))
    m = {
        "format": _manifest.FORMAT,
        "format_version": _manifest.FORMAT_VERSION,
        "step": step,
        "epoch": 0,
        "samples": 0,
        "saved_at": "2026-01-01T00:00:00Z",
        "saved_at_unix": time.time(),
        "world_size": 1,
        "components": {"model": {"kind": "module", "rank_local": False}},
        "versions": {},
        "files": files,
        "meta": {},
    }
    m[_manifest.SELF_CHECKSUM] = _manifest.self_checksum(m)
    with open(os.path.join(ckpt_dir, _manifest.MANIFEST), "wb") as f:
        f.write(_manifest.dumps(m))


def run_dir_with(run: str, tensors: dict[str, tuple[torch.Tensor, Iterable[Box]]]) -> str:
    """A run directory whose only checkpoint (step 1) holds ``tensors``; returns its path."""
    d = os.path.join(run, _layout.CHECKPOINTS, _layout.step_name(1))
    write(d, tensors)
    return d
