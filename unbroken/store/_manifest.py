"""The JSON manifest written last into every checkpoint, and bounded, strict JSON reading."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import xxhash

from .._errors import CorruptCheckpointError
from ._dcpio import safe_file

FORMAT = "unbroken-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE_FILE = "state.json"
MAX_JSON_BYTES = 512 << 20
SELF_CHECKSUM = "manifest_xxh3_64"
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def dumps(obj: Any) -> bytes:
    """Canonical JSON bytes: strict (no NaN), sorted keys, UTF-8."""
    return json.dumps(obj, allow_nan=False, sort_keys=True, separators=(",", ":")).encode()


def self_checksum(manifest: dict[str, Any]) -> str:
    """xxh3-64 of the manifest's canonical JSON without its own checksum field."""
    body = {k: v for k, v in manifest.items() if k != SELF_CHECKSUM}
    return xxhash.xxh3_64_hexdigest(dumps(body))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def read_json(directory: str, name: str) -> Any:
    """Parse ``name`` inside ``directory``: a regular file, size-bounded, strict JSON."""
    path = safe_file(directory, name)
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{path} is {size} bytes, larger than any state file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON: {e}") from None


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a checkpoint directory, its schema checked (not yet its checksums)."""
    m = read_json(directory, MANIFEST)
    where = os.path.join(directory, MANIFEST)
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where} is not an unbroken manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where} has format version {m.get('format_version')!r}; this unbroken reads "
            f"version {FORMAT_VERSION} (upgrade unbroken to read newer checkpoints)"
        )
    if m.get(SELF_CHECKSUM) != self_checksum(m):
        # The manifest is the one file no other record covers; a flipped bit in its step,
        # world size or file list must not go unnoticed.
        raise CorruptCheckpointError(f"{where} does not match its own checksum (corrupted)")
    for key, kind in (("step", int), ("world_size", int), ("files", dict), ("components", dict)):
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            raise CorruptCheckpointError(f"{where}: field {key!r} is missing or malformed")
    for name, rec in m["files"].items():
        ok = isinstance(rec, dict) and isinstance(rec.get("size"), int)
        if not ok or not _HEX16.match(str(rec.get("xxh3_64", ""))):
            raise CorruptCheckpointError(f"{where}: record of file {name!r} is malformed")
    return m


def verify_files(directory: str, manifest: dict[str, Any], *, checksums: bool = True) -> None:
    """Raise CorruptCheckpointError naming the first listed file that is missing or differs."""
    for name, rec in sorted(manifest["files"].items()):
        path = safe_file(directory, name)
        size = os.lstat(path).st_size
        if size != rec["size"]:
            raise CorruptCheckpointError(
                f"{path} has {size} bytes, the manifest says {rec['size']} (truncated?)"
            )
        if checksums and hash_file(path) != rec["xxh3_64"]:
            raise CorruptCheckpointError(f"{path} does not match its xxh3 checksum (corrupted)")


def hash_file(path: str, chunk: int = 8 << 20) -> str:
    h = xxhash.xxh3_64()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
