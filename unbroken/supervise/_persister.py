"""The supervisor's persister: a helper process, started with the supervisor, that has already
imported the store (and torch) when the first crash needs a snapshot persisted.

Importing them at the first crash cost that crash ~2 s more than later ones. Importing them in
a thread of the supervisor instead held its GIL in long C calls (loading torch's libraries:
up to ~0.8 s on a loaded machine), which delayed the supervisor's signal handlers -- a stop
forwarded late. In a process of its own the import delays nothing, and the supervisor itself
stays torch-free (its memory small). One request per line on its stdin, one answer per line
on its stdout (JSON); it exits when its stdin closes (the supervisor exited, or was killed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import IO

from . import _job

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


LOCK_WAIT = 90.0
"""Seconds a persist waits for the run directory's lock held by another process: in a job over
several nodes the supervisors of the surviving nodes persist their parts of one snapshot at
once (each persist takes well under a second), and a surviving trainer that holds the lock
ends only once it sees the lost rank dead: in 15-45 s when the backend does not tell it
(unbroken/_dist.py, the beats and the watchdog). A persist given up loses the snapshot."""


def _expendable() -> None:
    """In the persister, before ``exec``: a high ``oom_score_adj`` (no privilege needed)."""
    _job.set_oom_score(0, _job.OOM_PERSISTER)


class PersistFailed(Exception):
    """The helper could not persist the snapshot (its message says why)."""


class Persister:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        # This very package, whatever the cwd holds; its own session, so neither a terminal's
        # Ctrl-C nor a job-wide signal interrupts a persist half-way. When memory runs out the
        # kernel kills it before the trainer (its ~330 MB are torch's; the supervisor persists
        # a snapshot itself when it is gone).
        code = f"import sys; sys.path.insert(0, {_PACKAGE_PARENT!r}); "
        code += "from unbroken.supervise._persister import main; main()"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
                preexec_fn=_expendable,
            )
        except OSError:
            self.proc = None  # persist() imports in the supervisor then

    def persist(self, area: str, run_dir: str) -> int | None:
        """Persist ``area``'s newest snapshot into ``run_dir`` (store/snapshot/_area.py
        ``persist``); its step, or None when nothing newer was there. Raises PersistFailed."""
        proc = self.proc
        if proc is None or proc.poll() is not None or proc.stdin is None or proc.stdout is None:
            from ..store.snapshot._area import persist  # the helper is gone: do it here

            return persist(area, run_dir, wait=LOCK_WAIT)
        try:
            proc.stdin.write(json.dumps([area, run_dir]) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except OSError as e:
            raise PersistFailed(f"the persister process failed: {e}") from None
        if not line:
            raise PersistFailed(f"the persister process died (exit {proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise PersistFailed(answer["error"])
        step = answer.get("step")
        return None if step is None else int(step)

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        # No persist is in flight (they are synchronous), and one still importing must not
        # hold up the supervisor's exit.
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def serve(requests: IO[str], answers: IO[str]) -> None:
    from ..store.snapshot._area import persist

    for line in requests:
        area, run_dir = json.loads(line)
        answer: dict[str, object]
        try:
            answer = {"step": persist(area, run_dir, wait=LOCK_WAIT)}
        except Exception as e:  # reported by the supervisor, which goes on supervising
            answer = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main() -> None:
    # The supervisor decides; stdin EOF ends us. A scheduler's stop reaches every process of
    # the job, this one too, just when the supervisor may still need a persist.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    serve(sys.stdin, sys.stdout)
