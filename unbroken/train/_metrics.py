"""The per-step metrics log: ``RUN/metrics.jsonl``, one object per step, resumes marked.

Each checkpoint records the log's byte length; a resume truncates the log there (the steps
after it are about to be redone, identically) and appends ``{"event": "resume", ...}``. So the
log always holds each step exactly once, in order, across any number of interruptions. The log
is fsynced before each checkpoint commits, so it is never shorter than a checkpoint records;
one that is anyway (cut by hand, or by a power loss under an older version) is repaired to
whole lines and the gap is logged (``{"event": "log_gap"}``), never merged into.

Step records are held in memory, not written with one ``write`` a step (a syscall costs more
than the rest of ``run.step()`` on a busy machine): they reach the file before anything records
the log's length (a checkpoint, a snapshot), with every event, when the log closes, at
interpreter exit, and at least every :data:`FLUSH_SECONDS`, so that ``tail -f`` and watchers
follow the run. What a ``kill -9`` loses from memory is only steps after the last checkpoint or
snapshot: the resume cuts the log there and redoes those steps, logging them again. A loss
still on the device is read when its line is written, a whole flush's at once: no device sync
a step.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref
from typing import Any

import torch

from ..errors import CheckpointWriteError
from ..process import _log
from ..process._logfile import METRICS_FILE, open_regular, read_metrics
from ..store import _fsops

__all__ = ["METRICS_FILE", "MetricsLog", "read_metrics"]

log = _log.get("run")

FLUSH_SECONDS = 1.0
"""The longest a step's record waits in memory (``tail -f`` sees each step within it). In a
process's first seconds the wait is shorter (:data:`EARLY` times the log's age): the first
steps of a run, which a user or a watching script looks for, show at once, for a few dozen
writes."""
EARLY = 1 / 8


class MetricsLog:
    def __init__(
        self,
        run_dir: str,
        resume_offset: int | None,
        step: int | None = None,
        *,
        every_step: bool = False,
    ) -> None:
        self.path = os.path.join(run_dir, METRICS_FILE)
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, "metrics log")
        self._f = open(fd, "r+b", buffering=0)
        self._pending: list[dict[str, Any]] = []
        self._opened = time.monotonic()
        self._due = self._opened
        # Under `unbroken verify`, which fires its step targets when the log shows the step:
        # each step is written as it ends (hitting the step matters more than microseconds).
        self._every_step = every_step
        self._pid = os.getpid()  # a forked child (a loader worker) must not write our lines
        _OPEN.add(self)
        size = self._f.seek(0, os.SEEK_END)
        offset = resume_offset or 0
        self.lost = max(offset - size, 0)
        if size > offset:
            if step is not None and offset and not self._ends_at(offset, step):
                # The log was repaired (or edited) since that checkpoint: its recorded length
                # no longer falls after step ``step``'s line. Cut after that step's records.
                offset = self._after_step(step)
            self._f.truncate(offset)
        elif self.lost:
            self._repair(size, offset, step)
        self._f.seek(0, os.SEEK_END)

    def _ends_at(self, offset: int, step: int) -> bool:
        """Whether a record of ``step`` ends exactly at ``offset`` (what a save records)."""
        self._f.seek(max(0, offset - 65536))
        head = self._f.read(offset - max(0, offset - 65536))
        if not head.endswith(b"\n"):
            return False
        last = head[:-1].rsplit(b"\n", 1)[-1]
        try:
            rec = json.loads(last)
        except ValueError:
            return False
        return isinstance(rec, dict) and rec.get("step") == step

    def _after_step(self, step: int) -> int:
        """The byte offset after the last line that precedes the first record of a later
        step (those steps are about to be redone)."""
        self._f.seek(0)
        pos = 0
        for line in self._f.read().split(b"\n")[:-1]:
            try:
                rec = json.loads(line)
            except ValueError:
                break
            if not isinstance(rec, dict):
                break
            if "event" not in rec and isinstance(rec.get("step"), int) and rec["step"] > step:
                break
            pos += len(line) + 1
        return pos

    def _repair(self, size: int, offset: int, step: int | None) -> None:
        """The log is shorter than the checkpoint recorded: its tail was lost (a power loss
        before it was fsynced with the checkpoint, or someone cut it). A torn last line is
        dropped, so that the next record starts a line of its own (appending to it would merge
        two records into one unreadable line); the loss is logged and warned about. The lost
        steps are not redone: training state comes from the checkpoint, not from the log."""
        end = size
        while end > 0:
            start = max(0, end - 65536)
            self._f.seek(start)
            chunk = self._f.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                break  # whole lines only: nothing torn
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                self._f.truncate(start + nl + 1)
                break
            end = start
        else:
            self._f.truncate(0)  # the only line is torn
        self._f.seek(0, os.SEEK_END)
        _log.event(
            log,
            logging.WARNING,
            "unbroken: the metrics log %s holds %d bytes but the checkpoint recorded %d: its "
            "last %d bytes were lost (e.g. a power loss); the records of those steps are "
            "missing and are not redone",
            self.path,
            size,
            offset,
            offset - size,
            step=step,
            path=self.path,
        )
        self.event("log_gap", step=step, missing_bytes=offset - size)

    def event(self, kind: str, **fields: Any) -> None:
        # Events are rare and say what happened to the run: written at once, after the steps.
        self._pending.append({"event": kind, "time": round(time.time(), 3), **fields})
        self.flush()

    def step(self, record: dict[str, Any]) -> None:
        """One step's record, written at the next flush (its values are read then: a tensor
        in it must not change in place afterwards)."""
        self._pending.append(record)
        if self._every_step or time.monotonic() >= self._due:
            self.flush()

    def flush(self) -> None:
        """Write every record held in memory (one ``write``)."""
        now = time.monotonic()
        self._due = now + min(FLUSH_SECONDS, (now - self._opened) * EARLY)
        if not self._pending or os.getpid() != self._pid or self._f.closed:
            return
        records, self._pending = self._pending, []
        text = "".join(lines(records))
        data = memoryview(text.encode())
        try:
            while data:
                data = data[self._f.write(data) or 0 :]
        except OSError as e:
            raise _log_error(e, self.path) from e

    def offset(self) -> int:
        """The byte length, after an fsync: every checkpoint records it, and the log must
        hold that much on disk before the checkpoint commits (a power loss then leaves no
        log shorter than its checkpoint says)."""
        self.flush()
        try:
            _fsops.event("fsync_log", self.path)
            os.fsync(self._f.fileno())
        except OSError as e:
            raise _log_error(e, self.path) from e
        return self._f.tell()

    def length(self) -> int:
        """The byte length now, without an fsync (an in-memory snapshot records it; the
        supervisor fsyncs the log when it persists the snapshot, so it must be in the file)."""
        self.flush()
        return self._f.tell()

    def close(self) -> None:
        if not self._f.closed:
            try:
                self.flush()
            finally:
                self._f.close()
                _OPEN.discard(self)


_OPEN: weakref.WeakSet[MetricsLog] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """A script that ends (or fails) without closing its run still leaves every step it
    logged in the file. Registered after unbroken.process._quick_exit's handler, so it runs
    first."""
    for m in list(_OPEN):
        try:
            m.flush()
        except Exception as e:  # the exit goes on; the warning says what is missing
            log.warning("unbroken: writing the metrics log at exit failed: %s", e)


_SIMPLE = frozenset({int, float, str, bool, type(None)})
"""Types whose values :func:`plain` returns as they are (none has ``item``)."""


_STEP_KEYS = ("step", "epoch", "loss")


def lines(records: list[dict[str, Any]]) -> list[str]:
    """Each record as ``json.dumps({k: plain(v) ...}, allow_nan=True)`` and a newline, byte
    for byte, at a fraction of the cost. ``run.step()``'s own record (an int step and epoch, a
    finite float loss) is spelled by an f-string, as the encoder spells it. The others: one C
    encoder, built as ``json.dumps`` builds it for every record (most of its time for a step's
    three numbers), encodes them all (its circular-reference markers are empty again after each
    record it encodes); records of plain values are not copied, the others go through
    :func:`plain` and have their device tensors read first (tests/unit/test_step_fast_path.py
    holds the two to ``json.dumps``)."""
    keys, text, simple = _STEP_KEYS, float.__repr__, _SIMPLE
    out: list[Any] = []
    for r in records:
        if len(r) == 3 and tuple(r) == keys:
            # run.step()'s record, spelled as the encoder spells it: an int as int.__repr__
            # (what str() of an int is), a finite float as float.__repr__ (x - x is 0.0 for
            # exactly those; NaN and the infinities go to the encoder).
            step, epoch, loss = r.values()
            if (
                type(step) is int
                and type(epoch) is int
                and type(loss) is float
                and loss - loss == 0.0
            ):
                out.append(f'{{"step": {step}, "epoch": {epoch}, "loss": {text(loss)}}}\n')
                continue
        out.append(r)  # the encoder's, below
    rest = [i for i, r in enumerate(out) if not isinstance(r, str)]
    if not rest:
        return out
    mixed = {i for i in rest if not all(type(v) in simple for v in out[i].values())}
    if mixed:
        _read_tensors([out[i] for i in sorted(mixed)])
    encode = _encoder()
    for i in rest:
        r = out[i]
        if i in mixed:
            r = {k: plain(v) for k, v in r.items()}
        out[i] = ("".join(encode(r, 0)) if encode else json.dumps(r, allow_nan=True)) + "\n"
    return out


def _encoder() -> Any:
    """The C encoder ``json.dumps(obj, allow_nan=True)`` uses (its default encoder's
    settings), or None where the C accelerator is missing."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    e = json._default_encoder  # type: ignore[attr-defined]
    return make(
        {} if e.check_circular else None,
        e.default,
        json.encoder.encode_basestring_ascii if e.ensure_ascii else json.encoder.encode_basestring,
        e.indent,
        e.key_separator,
        e.item_separator,
        e.sort_keys,
        e.skipkeys,
        e.allow_nan,
    )


def _read_tensors(records: list[dict[str, Any]]) -> None:
    """Put values for the one-element tensors held on a device: one transfer per device and
    dtype for a whole flush (an ``.item()`` each would wait for the device each time)."""
    groups: dict[tuple[Any, Any], list[tuple[dict[str, Any], str]]] = {}
    for r in records:
        for k, v in r.items():
            if isinstance(v, torch.Tensor) and v.device.type != "cpu" and v.numel() == 1:
                groups.setdefault((v.device, v.dtype), []).append((r, k))
    for where in groups.values():
        values = torch.stack([r[k].detach().reshape(()) for r, k in where]).tolist()
        for (r, k), value in zip(where, values, strict=True):
            r[k] = value


def _log_error(e: OSError, path: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"writing the metrics log {path} failed: [Errno {e.errno}] {e.strerror}",
        errno=e.errno,
        path=path,
    )


def plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach()
        return v.item() if v.numel() == 1 else v.tolist()
    if hasattr(v, "item") and callable(v.item) and not isinstance(v, (list, dict, str)):
        try:
            return v.item()
        except (TypeError, ValueError):
            return v
    return v
