"""unbroken's operational log: the ``unbroken`` logger (and its children), and which rank says what.

Every operational event -- a resume, a save, a fallback past an unusable checkpoint, a stop,
retention, a lock taken over -- is a record of ``logging.getLogger("unbroken")`` or a child
(``unbroken.run``, ``unbroken.store``, ...); ``warnings`` is kept for misuse of the API, so
``python -W error`` never turns an event into an exception.

Ranks. An event of the whole run is logged by rank 0 at its level and by every other rank at
DEBUG, so N ranks do not repeat each line N times (enable DEBUG on ``unbroken`` to see every
rank). A problem of one rank only (``rank_local=True``) keeps its level on that rank. Every
record carries ``rank`` (so a format may use ``%(rank)s``) and, where known, ``step`` and
``path``.

Handlers. None is installed, not even a ``NullHandler``: with logging left unconfigured,
records of WARNING and above reach stderr through ``logging.lastResort`` -- so the stop message
("stopped at step N ...; relaunch the same command to continue") is seen by default -- and INFO
(save, model change) needs ``logging.basicConfig(level=logging.INFO)`` or a handler of your own.

Announcements. A resume is INFO, yet a job log must show that a run resumed, and from where:
:func:`announce` writes it to stderr as ``logging.lastResort`` would when logging is left
unconfigured; once a handler is configured, the record goes through it at INFO like any other.
``logging.getLogger("unbroken").setLevel(logging.WARNING)`` silences it either way.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

ROOT = "unbroken"


def get(name: str = "") -> logging.Logger:
    return logging.getLogger(f"{ROOT}.{name}" if name else ROOT)


def this_rank() -> int:
    if "torch.distributed" in sys.modules:  # else no process group can exist: torch-free tools
        from .. import _dist

        if _dist.active():
            return _dist.rank()
    # Before init_process_group (or in a tool), torchrun's or srun's variables say which rank.
    for var in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


def event(
    logger: logging.Logger,
    level: int,
    msg: str,
    *args: Any,
    rank_local: bool = False,
    step: int | None = None,
    path: str | None = None,
) -> None:
    """Log one operational event under the rank policy above."""
    rank = this_rank()
    if rank != 0 and not rank_local:
        level = logging.DEBUG  # rank 0 says it for the run
    if logger.isEnabledFor(level):
        extra = {"rank": rank, "step": step, "path": path}
        logger.log(level, msg, *args, extra=extra, stacklevel=2)


def announce(
    logger: logging.Logger, msg: str, *args: Any, step: int | None = None, path: str | None = None
) -> None:
    """An INFO event that rank 0 also prints to stderr while logging is unconfigured (see
    "Announcements" above); quiet once a level above INFO is set on ``unbroken`` (or a child)."""
    if this_rank() != 0 or logger.hasHandlers() or _quieted(logger):
        event(logger, logging.INFO, msg, *args, step=step, path=path)
        return
    # What logging.lastResort does for WARNING, for this one INFO record: the message alone,
    # on the stderr of the moment.
    extra = {"rank": 0, "step": step, "path": path}
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, msg, args, None, extra=extra)
    logging.StreamHandler(sys.stderr).handle(record)


def say(logger: logging.Logger, msg: str, *args: Any) -> None:
    """A decision of the run, said once by the process that makes it: on stderr whatever
    logging's configuration (a script that logs to a file of its own at INFO must not hide
    it), and to ``logger`` at DEBUG. The caller decides which rank says it."""
    text = msg % args if args else msg
    try:
        sys.stderr.write(f"unbroken: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # no stderr (closed): the log below still has it
        pass
    logger.debug(msg, *args, extra={"rank": this_rank(), "step": None, "path": None})


def _quieted(logger: logging.Logger) -> bool:
    """A level set explicitly on ``logger`` or an ancestor below the root, above INFO."""
    node: Any = logger
    while node is not None and node.name != "root":
        if node.level != logging.NOTSET:
            return bool(node.level > logging.INFO)
        node = node.parent if node.propagate else None
    return False
