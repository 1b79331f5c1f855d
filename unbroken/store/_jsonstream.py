"""Strict JSON read from a file a piece at a time, for documents too large to hold as objects.

``json.loads`` of a tensor table builds a dict, two lists and a dozen strings per chunk: about
ten times the file's size in memory, before anything is validated. Here the caller walks the
containers it expects (:meth:`JsonStream.members`, :meth:`JsonStream.elements`) and decodes
only leaves -- a chunk's record, a shape -- with the C decoder (:meth:`JsonStream.value`),
keeping what it needs in compact form. Memory stays at one block of text plus the largest
leaf (at most :data:`LEAF_MAX` characters); time is linear in the file's size.

Same strictness as ``_safeio.parse_json``: UTF-8, no NaN/Infinity, no number that overflows to
infinity, nothing after the document; each failure a CorruptCheckpointError naming the file.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from ..errors import CorruptCheckpointError
from ._safeio import _finite, _reject_constant

BLOCK = 256 << 10
LEAF_MAX = 1 << 24
"""The largest single value (a chunk's record, a name) decoded at once, in characters."""
_WS = re.compile(r"[ \t\n\r]*")


class JsonStream:
    """The JSON document in ``fd`` (read from its current position), walked by the caller."""

    def __init__(self, fd: int, where: str) -> None:
        self.fd, self.where = fd, where
        self._dec = codecs.getincrementaldecoder("utf-8")("strict")
        self._json = json.JSONDecoder(parse_float=_finite, parse_constant=_reject_constant)
        self.buf, self.pos, self.eof = "", 0, False

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where} is not valid JSON: {what}")

    def _more(self) -> bool:
        """Append the next block (dropping what was consumed); False at the end of the file."""
        if self.eof:
            return False
        raw = os.read(self.fd, BLOCK)
        try:
            text = self._dec.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            raise self.fail(str(e)) from None
        self.eof = not raw
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not whitespace (not consumed)."""
        buf, pos = self.buf, self.pos
        if pos < len(buf) and buf[pos] not in " \t\n\r":
            return buf[pos]
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                raise self.fail("it ends early")

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise self.fail(f"expected {char!r} at {self._context()}")
        self.pos += 1

    def value(self) -> Any:
        """Decode the next value (a leaf the caller keeps or checks), at most LEAF_MAX long."""
        self.peek()
        while True:
            try:
                value, end = self._json.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if not self.eof and len(self.buf) - self.pos < LEAF_MAX and self._more():
                    continue  # cut by the end of the block
                raise self.fail(f"{e.msg} at {self._context()}") from None
            except RecursionError:
                raise CorruptCheckpointError(
                    f"{self.where} is nested too deeply to be unbroken's"
                ) from None
            except ValueError as e:  # a number that overflows, NaN, Infinity
                raise self.fail(str(e)[:200]) from None
            if end == len(self.buf) and not self.eof and self._more():
                continue  # a number may go on in the next block
            self.pos = end
            return value

    def small_value(self) -> tuple[bool, Any]:
        """``(True, value)`` when the next value is complete within about one block of text
        (decoded at once, fast); else ``(False, None)``, nothing consumed: walk it instead
        (which also reports what is wrong with it)."""
        self.peek()
        if len(self.buf) - self.pos < BLOCK // 2:
            self._more()
        try:
            value, end = self._json.raw_decode(self.buf, self.pos)
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return False, None
        if end == len(self.buf) and not self.eof:
            return False, None  # a number might go on
        self.pos = end
        return True, value

    def members(self) -> Iterator[str]:
        """The keys of the object that comes next; the caller consumes each one's value
        (:meth:`value`, or a nested walk) before asking for the next key."""
        self.expect("{")
        if self.peek() == "}":
            self.pos += 1
            return
        while True:
            if self.peek() != '"':
                raise self.fail(f"expected a key at {self._context()}")
            key = self.value()
            self.expect(":")
            yield key
            c = self.peek()
            self.pos += 1
            if c == "}":
                return
            if c != ",":
                raise self.fail(f"expected ',' or '}}' at {self._context()}")

    def elements(self) -> Iterator[int]:
        """The positions 0, 1, ... of the array that comes next; the caller consumes each."""
        self.expect("[")
        if self.peek() == "]":
            self.pos += 1
            return
        i = 0
        while True:
            yield i
            i += 1
            c = self.peek()
            self.pos += 1
            if c == "]":
                return
            if c != ",":
                raise self.fail(f"expected ',' or ']' at {self._context()}")

    def end(self) -> None:
        """Nothing but whitespace may follow the document."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                raise self.fail(f"extra data at {self._context()}")
            if not self._more():
                return

    def _context(self) -> str:
        return repr(self.buf[self.pos : self.pos + 20])
