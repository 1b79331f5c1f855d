"""Fault injection for tests: a hook on the store's named filesystem events.

The library announces every filesystem operation of a save as a named event
(``unbroken.store._fsops.event``) and calls a hook only when one is installed with
``_fsops.set_hook``; nothing in the library reads the environment for it. Tests install it:
in process with :func:`hook`, and in a launched script, which calls :func:`install_from_env`
first thing, from two variables the test sets:

``UNBROKEN_FAULT_LOG=FILE`` appends one line per event; ``UNBROKEN_FAULT=kill:K`` SIGKILLs the
process at event K (1-based); ``UNBROKEN_FAULT=errno:NAME:EVENT[:N]`` raises OSError(NAME) at
the N-th event called EVENT; ``UNBROKEN_FAULT=slow:SECONDS`` sleeps SECONDS at every event of a
checkpoint save, so an outside watcher (``unbroken verify`` on a loaded machine) sees the save's
``.tmp-step-N`` directory and its SIGKILL lands inside the save.
"""

from __future__ import annotations

import errno as _errno
import os
import signal
import time

from unbroken.store import _fsops

PLAN_ENV = "UNBROKEN_FAULT"
LOG_ENV = "UNBROKEN_FAULT_LOG"


def hook(plan: str | None, log: str | None) -> _fsops.Hook:
    """A hook that logs each event to ``log`` and acts on ``plan`` (see the module doc)."""
    counts: dict[str, int] = {}
    total = [0]

    def on_event(name: str, path: str) -> None:
        total[0] += 1
        counts[name] = counts.get(name, 0) + 1
        if log:
            with open(log, "a") as f:
                f.write(f"{total[0]}\t{name}\t{os.path.basename(path)}\n")
        if not plan:
            return
        kind, _, rest = plan.partition(":")
        if kind == "slow" and name != "fsync_log":
            time.sleep(float(rest))
        if kind == "kill" and int(rest) == total[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "errno":
            code, _, where = rest.partition(":")
            ev, _, nth = where.partition(":")
            if ev == name and counts[name] == int(nth or 1):
                num = getattr(_errno, code)
                raise OSError(num, os.strerror(num), path)

    return on_event


def install_from_env() -> None:
    """Install :func:`hook` when the test that launched this process asked for one."""
    plan, log = os.environ.get(PLAN_ENV), os.environ.get(LOG_ENV)
    if plan or log:
        _fsops.set_hook(hook(plan, log))
