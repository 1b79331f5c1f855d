"""Capture what unbroken logs (its operational events are log records, not warnings)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.messages.append(record.getMessage())


@contextmanager
def _kept(level: int) -> Iterator[_Keep]:
    logger = logging.getLogger("unbroken")
    keep, old = _Keep(), logger.level
    logger.addHandler(keep)
    logger.setLevel(level)
    try:
        yield keep
    finally:
        logger.removeHandler(keep)
        logger.setLevel(old)


@contextmanager
def logged(level: int = logging.WARNING) -> Iterator[list[str]]:
    """The messages the ``unbroken`` loggers emit at ``level`` or above inside the block
    (the list fills as they are logged)."""
    with _kept(level) as keep:
        yield keep.messages


@contextmanager
def log_records(level: int = logging.WARNING) -> Iterator[list[logging.LogRecord]]:
    with _kept(level) as keep:
        yield keep.records


@contextmanager
def logs_match(pattern: str, level: int = logging.WARNING) -> Iterator[list[str]]:
    """Like ``pytest.warns(match=...)`` for unbroken's log: some message logged inside the
    block matches ``pattern`` (re.search), else AssertionError listing what was logged."""
    import re

    with logged(level) as messages:
        yield messages
    assert any(re.search(pattern, m) for m in messages), (pattern, messages)
