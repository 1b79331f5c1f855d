"""The JSON manifest written last into every checkpoint, and bounded, strict JSON reading."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import xxhash

from ..errors import CheckpointError, CorruptCheckpointError
from ._safeio import open_regular, safe_file
from ._safeio import read_json as read_json

FORMAT = "unbroken-checkpoint"
FORMAT_VERSION = 2
"""Written by this unbroken: tensors as raw bytes + JSON (_format). 1: DCP's pickled format."""
READABLE_VERSIONS = (2,)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
MAX_WORLD_SIZE = 1 << 20
MAX_FILES = 1 << 22
STATE_FILE = "state.json"
SELF_CHECKSUM = "manifest_xxh3_64"
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def build(
    step: int, payload: Any, files: dict[str, tuple[int, str]], meta: dict[str, Any], world: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state.json's document, the manifest) of a commit of ``payload`` (a state.Payload)
    whose other files are ``files`` ({name: (size, xxh3)}). Plain JSON: rank 0 can hand both
    to the ranks that commit the same checkpoint in other directories (store/snapshot/_nodes.py)."""
    import platform
    import time

    import torch

    from .._version import __version__

    state_doc = {"components": payload.global_trees}
    data = dumps(state_doc)
    files = {**files, STATE_FILE: (len(data), xxhash.xxh3_64_hexdigest(data))}
    now = time.time()
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "epoch": meta.get("epoch"),
        "samples": meta.get("samples"),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "saved_at_unix": now,
        "world_size": world,
        "components": {
            name: {"kind": payload.kinds.get(name, "stateful"), "rank_local": local}
            for names, local in ((payload.global_trees, False), (payload.local_trees, True))
            for name in names
        },
        "versions": {
            "unbroken": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "files": {k: {"size": s, "xxh3_64": h} for k, (s, h) in sorted(files.items())},
        "meta": meta,
    }
    manifest[SELF_CHECKSUM] = self_checksum(manifest)
    return state_doc, manifest


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def dumps(obj: Any) -> bytes:
    """Canonical JSON bytes: strict (no NaN), sorted keys, UTF-8."""
    return json.dumps(obj, allow_nan=False, sort_keys=True, separators=(",", ":")).encode()


def self_checksum(manifest: dict[str, Any]) -> str:
    """xxh3-64 of the manifest's canonical JSON without its own checksum field."""
    body = {k: v for k, v in manifest.items() if k != SELF_CHECKSUM}
    return xxhash.xxh3_64_hexdigest(dumps(body))


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a checkpoint directory, its schema checked (not yet its checksums)."""
    m = read_json(directory, MANIFEST, MAX_MANIFEST_BYTES)
    return check_manifest(m, os.path.join(directory, MANIFEST))


def check_manifest(m: Any, where: str) -> dict[str, Any]:
    """The schema check of a parsed manifest (from a directory or an object store)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where} is not an unbroken manifest")
    version = m.get("format_version")
    if version == 1 and not isinstance(version, bool):
        # Format 1 (pickled DCP records) lived for one afternoon before any release.
        raise CorruptCheckpointError(
            f"{where} is checkpoint format 1, written by a pre-release unbroken; this unbroken "
            "reads format 2 only. Export its weights with the unbroken that wrote it "
            "(`unbroken export`), or start the run over: Run(..., start_over=True) moves the "
            "old checkpoints aside, deleting nothing"
        )
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CorruptCheckpointError(
            f"{where} has format version {version!r}; this unbroken reads versions "
            f"{list(READABLE_VERSIONS)} (upgrade unbroken to read newer checkpoints)"
        )
    if m.get(SELF_CHECKSUM) != self_checksum(m):
        # The manifest is the one file no other record covers; a flipped bit in its step,
        # world size or file list must not go unnoticed.
        raise CorruptCheckpointError(f"{where} does not match its own checksum (corrupted)")
    for key, kind in (("step", int), ("world_size", int), ("files", dict), ("components", dict)):
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            raise CorruptCheckpointError(f"{where}: field {key!r} is missing or malformed")
    if not 0 <= m["step"] < 1 << 62:
        raise CorruptCheckpointError(f"{where}: step {m['step']} is out of range")
    files = m["files"]
    if len(files) > MAX_FILES:
        raise CorruptCheckpointError(f"{where} lists {len(files)} files")
    # Bounded by the files it lists (one state file per rank), so that a crafted world size
    # cannot make a reader allocate or loop without bound.
    if not 1 <= m["world_size"] <= min(MAX_WORLD_SIZE, len(files)):
        raise CorruptCheckpointError(
            f"{where}: world size {m['world_size']} does not fit the {len(files)} files it lists"
        )
    for name, rec in files.items():
        ok = isinstance(rec, dict) and isinstance(rec.get("size"), int)
        ok = ok and not isinstance(rec.get("size"), bool) and 0 <= rec["size"] < 1 << 62
        if not ok or not _HEX16.match(str(rec.get("xxh3_64", ""))):
            raise CorruptCheckpointError(f"{where}: record of file {name!r} is malformed")
    meta = m.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{where}: field 'meta' is malformed")
    return m


def verify_files(
    directory: str,
    manifest: dict[str, Any],
    *,
    checksums: bool = True,
    skip: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Raise CorruptCheckpointError naming the first listed file that is missing or differs.
    Files in ``skip`` get their size checked only (format 2 data files: their checksums are
    per chunk, see _storage.verify_data)."""
    for name, rec in sorted(manifest["files"].items()):
        path = safe_file(directory, name)
        try:
            size = os.lstat(path).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing") from None
        if size != rec["size"]:
            raise CorruptCheckpointError(
                f"{path} has {size} bytes, the manifest says {rec['size']} (truncated?)"
            )
        if checksums and name not in skip and hash_file(path) != rec["xxh3_64"]:
            raise CorruptCheckpointError(f"{path} does not match its xxh3 checksum (corrupted)")


def hash_file(path: str, chunk: int = 8 << 20) -> str:
    h = xxhash.xxh3_64()
    with open(open_regular(path), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(max(1, min(chunk, size)))  # JSON files are small: no 8 MB buffer
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def sizes_ok(path: str, manifest: dict[str, Any]) -> bool:
    try:
        verify_files(path, manifest, checksums=False)
        return True
    except (CheckpointError, OSError):
        return False


def manifest_of(path: str) -> dict[str, Any] | None:
    """The checkpoint's manifest if it parses (a directory that is ours), else None."""
    try:
        return read_manifest(path)
    except CheckpointError:
        return None
