"""``unbroken ls`` and ``unbroken inspect``: what a run directory holds, read safely.

Neither command loads tensor data or unpickles anything: ``ls`` checks every checkpoint's
files against its manifest (sizes and xxh3, or sizes only with ``--no-verify``); ``inspect``
reads the manifest, the JSON state and the tensor table and runs every check a load runs
(``CheckpointReader.check_contents``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import sys
import time
import uuid
from array import array
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..process._exit import EXIT_NO_CHECKPOINT, EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:  # imported where used: `unbroken --help` must not import torch
    from ..store import CheckpointReader

LS_EPILOG = """exit codes: 0 at least one valid checkpoint, 3 none (or no run directory)

example: unbroken ls runs/gpt --json | jq '.[] | select(.valid) | .step'"""

INSPECT_EPILOG = """CKPT_OR_RUN is a checkpoint directory (RUN/checkpoints/step-NNNNNNNNN) or a run
directory, whose newest valid checkpoint is shown (or the one of --step N).

exit codes: 0 shown, 1 corrupt or unsafe, 2 usage error,
            3 no valid checkpoint (or no such step)

example: unbroken inspect runs/gpt --step 2000 --json"""


def register(subparsers: Any) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "ls",
        help="list the checkpoints of a run directory (step, size, age, valid, pinned)",
        description="List every checkpoint directory of RUN, newest first, verified.",
        epilog=LS_EPILOG,
        formatter_class=raw,
    )
    p.add_argument("run_dir", metavar="RUN", help="the run directory, or its s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object a row")
    p.add_argument(
        "--no-verify", action="store_true", help="check file sizes only, not checksums (faster)"
    )
    p.set_defaults(func=ls)

    p = subparsers.add_parser(
        "inspect",
        help="show what a checkpoint holds: counters, components, tensor shapes",
        description="Show a checkpoint's manifest, counters, components and tensor table.\n"
        "Read from the metadata only: no tensor data is loaded, nothing is unpickled.",
        epilog=INSPECT_EPILOG,
        formatter_class=raw,
    )
    p.add_argument(
        "path", metavar="CKPT_OR_RUN", help="a checkpoint or run directory (or s3:// URL)"
    )
    p.add_argument(
        "--step", type=int, metavar="N", help="in a run directory: the checkpoint of step N"
    )
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p.add_argument(
        "--no-verify", action="store_true", help="check file sizes only, not checksums (faster)"
    )
    p.set_defaults(func=inspect)


# ---- ls ---------------------------------------------------------------------------------------


def ls(args: argparse.Namespace) -> int:
    store = _run_store(args.run_dir)
    remote = _is_url(args.run_dir)
    now = time.time()
    rows = []
    latest_seen = False
    for item in store.listing(checksums=not args.no_verify):
        is_latest = item.valid and not latest_seen
        latest_seen = latest_seen or item.valid
        rows.append(
            {
                "step": item.step,
                "path": item.path,
                "valid": item.valid,
                "reason": item.reason,
                "latest": is_latest,
                "size_bytes": item.size if remote else _disk_size(item.path),
                "mtime": item.mtime,
                "saved_at_unix": item.saved_at,
                # From the commit time the manifest records: pinning changes the mtime.
                "age_seconds": round(max(now - (item.saved_at or item.mtime), 0.0), 3),
                "pinned": item.pinned,
                "checked": "sizes" if args.no_verify else "checksums",
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_ls(store, rows)
    if not latest_seen:
        print(f"unbroken: no valid checkpoint in {store.root}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    return EXIT_OK


def _is_url(path: str) -> bool:
    return "://" in path


def _run_store(run_dir: str) -> Any:
    from ..store import CheckpointStore

    if _is_url(run_dir):  # s3://bucket/prefix: the run's remote tier
        from ..store.remote._bucket import RemoteStore

        return RemoteStore(run_dir)
    if not os.path.isdir(run_dir):
        raise CheckpointNotFoundError(f"{run_dir} is not a directory")
    return CheckpointStore(run_dir)


def _print_ls(store: Any, rows: list[dict[str, Any]]) -> None:
    if not rows:
        print(f"no checkpoints in {store.root}")
        return
    table = []
    for r in rows:
        if r["valid"]:
            status = "valid, latest" if r["latest"] else "valid"
        else:
            status = "corrupt: " + r["reason"].replace(r["path"] + os.sep, "")
        pinned = "pinned" if r["pinned"] else ""
        table.append(
            [
                str(r["step"]),
                human_size(r["size_bytes"]),
                human_age(r["age_seconds"]),
                pinned,
                status,
            ]
        )
    for line in _table(["STEP", "SIZE", "AGE", "PINNED", "STATUS"], table, right={0, 1, 2}):
        print(line)
    stale = _stale(store.root)
    if stale:
        print(f"({stale} unfinished save(s) or deletion(s) left over; the next run removes them)")


def _stale(root: str) -> int:
    try:
        from ..store import _layout

        return sum(1 for name in os.listdir(root) if _layout.transient(name))
    except OSError:
        return 0


def _disk_size(path: str) -> int:
    total = 0
    try:
        for e in os.scandir(path):
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


# ---- inspect ----------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


def inspect(args: argparse.Namespace) -> int:
    try:
        info = _read_described(args.path, args.step, checksums=not args.no_verify)
    except _UsageError as e:
        print(f"unbroken inspect: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        raise CheckpointError(f"cannot read {args.path}: {e}") from None
    info["checked"] = "sizes" if args.no_verify else "checksums"
    if args.json:
        write_json(info, sys.stdout.write)
        sys.stdout.write("\n")
    else:
        for line in format_info(info):
            print(line)
    return EXIT_OK


RETENTION_RETRIES = 100


def _read_described(path: str, step: int | None, *, checksums: bool) -> dict[str, Any]:
    """:func:`describe` of the checkpoint :func:`_open` finds, after every check a load runs.
    A live run's retention may delete it while it is read: that is not corruption. Asked for
    a run directory's newest checkpoint, read the newest again; asked for that very
    checkpoint, say it was deleted."""
    target = _asked_for(path, step)  # None: the newest of a run directory
    existed = target is not None and os.path.isdir(target)
    for _ in range(RETENTION_RETRIES):
        reader = None
        try:
            reader = _open(path, step, checksums=checksums)
            reader.check_contents()  # refuse what a restore would refuse (nothing is restored)
            return describe(reader)
        except (CheckpointError, OSError):
            gone = target if target is not None else getattr(reader, "path", None)
            if gone is None or os.path.lexists(gone) or (target is not None and not existed):
                raise
            if target is None:
                continue  # a newer one committed before this one was deleted: read that
            raise CheckpointNotFoundError(
                f"{gone} was deleted while it was being read (retention of a live run?); "
                "nothing is wrong with the run directory"
            ) from None
    raise CheckpointNotFoundError(
        f"every checkpoint of {path} was deleted while it was being read, "
        f"{RETENTION_RETRIES} times in a row (retention of a live run saving very often?)"
    )


def _asked_for(path: str, step: int | None) -> str | None:
    """The checkpoint directory the command names (itself, or RUN's --step), else None."""
    from ..store import _layout
    from ..store._manifest import MANIFEST

    name = os.path.basename(os.path.normpath(path))
    if os.path.lexists(os.path.join(path, MANIFEST)) or _layout.parse_step(name) is not None:
        return path
    if step is not None:
        return os.path.join(_layout.checkpoints_dir(path), _layout.step_name(step))
    return None


def _open(path: str, step: int | None, *, checksums: bool) -> CheckpointReader:
    from ..store import CheckpointReader, CheckpointStore, _layout
    from ..store._manifest import MANIFEST

    if _is_url(path):
        return _open_remote(path, step, checksums=checksums)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path} is not a directory")
    name = os.path.basename(os.path.normpath(path))
    if os.path.lexists(os.path.join(path, MANIFEST)) or _layout.parse_step(name) is not None:
        if step is not None:
            raise _UsageError(f"--step applies to a run directory; {path} is one checkpoint")
        reader = CheckpointReader(path)
        reader.verify(checksums=checksums)
        return reader
    store = CheckpointStore(path)
    if step is not None:
        return store.open(step, checksums=checksums)
    # The fallback past an unusable checkpoint is a log record (unbroken/process/_log.py); a tool
    # says it on stderr whatever logging is configured, so it is collected here and printed.
    caught = _Collect()
    logger = logging.getLogger("unbroken")
    logger.addHandler(caught)
    every_one_failed = False
    try:
        found = store.latest(checksums=checksums)
    except CorruptCheckpointError:
        # Run refuses to start over on such a directory; for inspect it is "no valid
        # checkpoint" (exit 3, as ls), each one's cause in the warnings just collected.
        found, every_one_failed = None, True
    finally:
        logger.removeHandler(caught)
    for record in caught.records:
        text = record.getMessage().removeprefix("unbroken: ")
        print(f"unbroken: warning: {text}", file=sys.stderr)
    if every_one_failed:
        raise CheckpointNotFoundError(
            f"no valid checkpoint in {store.root}: none of its checkpoints can be read (each "
            "is named above, with why); nothing was changed"
        )
    if found is None:
        raise CheckpointNotFoundError(f"no valid checkpoint in {store.root}")
    return found


def _open_remote(url: str, step: int | None, *, checksums: bool) -> CheckpointReader:
    """``s3://bucket/prefix`` (a run's remote tier: its newest valid checkpoint, or that of
    ``step``) or ``s3://bucket/prefix/checkpoints/step-N`` (that checkpoint)."""
    from ..store import _layout
    from ..store.remote._bucket import RemoteStore

    head, _, name = url.rstrip("/").rpartition("/")
    named = _layout.parse_step(name)
    if named is not None and head.endswith("/" + _layout.CHECKPOINTS):
        if step is not None:
            raise _UsageError(f"--step applies to a run; {url} is one checkpoint")
        return RemoteStore(head[: -len(_layout.CHECKPOINTS) - 1]).open(named, checksums=checksums)
    store = RemoteStore(url)
    if step is not None:
        return store.open(step, checksums=checksums)
    found = store.latest(checksums=checksums)
    if found is None:
        raise CheckpointNotFoundError(f"no valid checkpoint in {store.root}")
    return found


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _Tensors:
    """Every tensor of a checkpoint as ``inspect`` shows it, without an object per tensor: the
    table's columns."""

    def __init__(self, reader: CheckpointReader) -> None:
        table = reader.tensor_table()
        self.names: list[str] = table.names
        self.shape: Any = table.shape_of
        self.dtype: Any = table.dtype_name_of

    def nbytes(self, i: int) -> int:
        from ..store._format import DTYPE_ITEMSIZE

        return math.prod(self.shape(i)) * DTYPE_ITEMSIZE[self.dtype(i)]  # validated names


class Rows:
    """The tensors of one component, as indices into :class:`_Tensors` (8 bytes each, and a
    rank): each row is made when it is shown or written, then dropped. A table of 100,000
    tensors cost ``inspect`` a dict, a list and strings per tensor, then a line each, all at
    once: 3-7x the checkpoint's size in memory (docs/checkpoint-format.md: below 2x)."""

    def __init__(self, tensors: _Tensors) -> None:
        self.tensors = tensors
        self.index = array("q")
        self.rank = array("q")  # -1: not rank-local

    def add(self, i: int, rank: int | None) -> None:
        self.index.append(i)
        self.rank.append(-1 if rank is None else rank)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def has_rank(self) -> bool:
        return any(r >= 0 for r in self.rank)

    def row(self, i: int, rank: int) -> dict[str, Any]:
        t = self.tensors
        row: dict[str, Any] = {
            "name": t.names[i].partition(_SEP)[2],
            "shape": list(t.shape(i)),
            "dtype": t.dtype(i),
            "bytes": t.nbytes(i),
        }
        if rank >= 0:
            row["rank"] = rank
        return row

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every row, in the table's order (``--json``)."""
        for i, rank in zip(self.index, self.rank, strict=True):
            yield self.row(i, rank)

    def by_rank_and_name(self) -> Iterator[tuple[int, int]]:
        """(index, rank) of every tensor, by rank (none: 0), then name (the table's view)."""
        ranks = sorted(set(self.rank), key=lambda r: max(r, 0))
        names = self.tensors.names
        for r in ranks:
            group = [i for i, rr in zip(self.index, self.rank, strict=True) if rr == r]
            group.sort(key=names.__getitem__)  # one prefix per group: the name's order
            for i in group:
                yield i, r


_SEP = "/"  # state/_nested.SEP: component, then the tensor's path


def describe(reader: CheckpointReader) -> dict[str, Any]:
    """Everything ``inspect`` shows, as JSON-ready values (no tensor data is read), but each
    component's ``tensors``: :class:`Rows`, made row by row (:func:`write_json`)."""
    from ..state import _nested

    assert _nested.SEP == _SEP
    m = reader.manifest
    tensors = _Tensors(reader)  # names, shapes and dtypes from the table
    trees = reader.global_trees()
    components: dict[str, dict[str, Any]] = {}
    for name, comp in sorted(m["components"].items()):
        if not isinstance(comp, dict):
            raise CorruptCheckpointError(f"{reader.path}: manifest entry of {name!r} is malformed")
        components[name] = {
            "kind": comp.get("kind"),
            "rank_local": bool(comp.get("rank_local")),
            "tensors": Rows(tensors),
            "tensor_bytes": 0,
        }
    for i, key in enumerate(tensors.names):
        head = key.partition(_SEP)[0]
        comp_name, _, rank = head.partition("@rank")
        comp = components.get(comp_name)
        if comp is None:
            comp = components[comp_name] = {
                "kind": None,
                "rank_local": bool(rank),
                "tensors": Rows(tensors),
                "tensor_bytes": 0,
            }
        comp["tensors"].add(i, int(rank) if rank else None)
        comp["tensor_bytes"] += tensors.nbytes(i)
    counters = {
        name: _jsonable(_decode(trees[name]))
        for name, comp in components.items()
        if comp["kind"] == "counters" and name in trees
    }
    del trees
    return {
        "path": reader.path,
        "step": reader.step,
        "epoch": m.get("epoch"),
        "samples": m.get("samples"),
        "world_size": reader.world_size,
        "saved_at": m.get("saved_at"),
        "saved_at_unix": m.get("saved_at_unix"),
        "format_version": m.get("format_version"),
        "versions": m.get("versions") or {},
        "meta": reader.meta,
        "size_bytes": reader.size_bytes(),
        "files": {k: v["size"] for k, v in sorted(m["files"].items())},
        "components": components,
        "counters": counters,
    }


def write_json(info: dict[str, Any], write: Callable[[str], Any]) -> None:
    """``json.dumps(info, indent=2)`` written piece by piece, each component's tensors a row
    at a time (the same text: the rows are put where placeholders were)."""
    marks: dict[str, Rows] = {}
    comps = {}
    for name, comp in info["components"].items():
        token = f"unbroken-rows-{uuid.uuid4().hex}"
        marks[json.dumps(token)] = comp["tensors"]
        comps[name] = {**comp, "tensors": token}
    text = json.dumps({**info, "components": comps}, indent=2)
    for line in text.split("\n"):
        quoted = next((q for q in marks if line.endswith((q, q + ","))), None)
        if quoted is None:
            write(line + "\n")
            continue
        rows = marks[quoted]
        head, tail = line[: line.rindex(quoted)], line[line.rindex(quoted) + len(quoted) :]
        indent = " " * (len(line) - len(line.lstrip(" ")) + 2)
        if not len(rows):
            write(f"{head}[]{tail}\n")
            continue
        write(f"{head}[")
        sep = "\n"
        for row in rows.rows():
            write(sep + indent + json.dumps(row, indent=2).replace("\n", "\n" + indent))
            sep = ",\n"
        write(f"\n{indent[:-2]}]{tail}\n")


def _decode(tree: Any) -> Any:
    from ..state import _nested

    try:
        return _nested.join(tree, {})
    except CorruptCheckpointError:
        return tree  # refers to tensors: show the JSON as stored


def _jsonable(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    return repr(obj)


def format_info(info: dict[str, Any]) -> Iterator[str]:
    """The human-readable form of :func:`describe`, line by line (a tensor's line is made
    when it is due: a table of many tensors is never held as lines)."""
    saved = info["saved_at"] or "?"
    if isinstance(info.get("saved_at_unix"), (int, float)):
        saved += f" ({human_age(time.time() - info['saved_at_unix'])} ago)"
    versions = ", ".join(f"{k} {v}" for k, v in sorted(info["versions"].items()))
    checked = "checksums verified" if info.get("checked") == "checksums" else "sizes checked"
    head = [
        ("checkpoint", info["path"]),
        ("step", str(info["step"])),
        ("epoch", _show(info["epoch"])),
        ("samples", _show(info["samples"])),
        ("world size", str(info["world_size"])),
        ("saved at", saved),
        ("versions", versions or "?"),
        ("size", f"{human_size(info['size_bytes'])} in {len(info['files'])} files ({checked})"),
    ]
    for name, values in info["counters"].items():
        if isinstance(values, dict):
            text = " ".join(f"{k}={_show(v)}" for k, v in values.items() if k != "version")
        else:
            text = _show(values)
        head.append((f"counters ({name})" if name != "counters" else "counters", text))
    width = max(len(k) for k, _ in head)
    lines = [f"{k:<{width}}  {v}" for k, v in head]
    comps = info["components"]
    lines += ["", "components"]
    rows = [
        [
            name,
            str(c["kind"] or "?"),
            "yes" if c["rank_local"] else "no",
            str(len(c["tensors"])),
            human_size(c["tensor_bytes"]),
        ]
        for name, c in comps.items()
    ]
    lines += _table(["NAME", "KIND", "RANK-LOCAL", "TENSORS", "SIZE"], rows, indent=2, right={3, 4})
    yield from lines
    for name, c in comps.items():
        tensors: Rows = c["tensors"]
        if not len(tensors):
            continue
        yield ""
        yield f"tensors of {name}"
        has_rank = tensors.has_rank
        headers = ["NAME", "SHAPE", "DTYPE"] + (["RANK"] if has_rank else [])

        def cells(tensors: Rows = tensors, has_rank: bool = has_rank) -> Iterator[list[str]]:
            names, t = tensors.tensors.names, tensors.tensors
            for i, rank in tensors.by_rank_and_name():
                row = [names[i].partition(_SEP)[2], _shape(t.shape(i)), t.dtype(i)]
                yield row + ([str(rank) if rank >= 0 else ""] if has_rank else [])

        yield from _stream_table(headers, cells, indent=2)


# ---- formatting -------------------------------------------------------------------------------


def _show(v: Any) -> str:
    return "-" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    s = max(int(seconds), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _stream_table(
    headers: list[str], rows: Callable[[], Iterator[list[str]]], *, indent: int = 0
) -> Iterator[str]:
    """:func:`_table` of the rows ``rows()`` yields, called twice (the widths, then the
    lines) so that they are never all held."""
    widths = [len(h) for h in headers]
    for r in rows():
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]
    for cells in itertools.chain([headers], rows()):
        line = "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
        yield (" " * indent + line).rstrip()


def _table(
    headers: list[str], rows: list[list[str]], *, indent: int = 0, right: Collection[int] = ()
) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    out = []
    for r in [headers, *rows]:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append((" " * indent + "  ".join(cells)).rstrip())
    return out
