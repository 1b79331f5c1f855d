"""One launch of the supervised command: its process tree, its stop markers, its leftovers.

``unbroken run -- torchrun ...`` must see through the launcher: a stop signal goes to every
rank (torchrun starts them in sessions of their own and dies of SIGUSR1), "every rank saved
and stopped" is a resumable stop whatever torchrun's exit code (it exits 1 when its ranks exit
75), and ranks left running after the launcher died are waited for before a relaunch (they
hold the run's lock and the master port). See :mod:`unbroken.process._tree` and
:mod:`unbroken.process._stops`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

from ..process import _protocol, _stops, _tree


def _follow(
    supervisor: int, idle: bool = False, oom: int | None = None, standby: bool = False
) -> Any:
    """A ``preexec_fn``: CMD gets SIGTERM when the supervisor dies (Linux ``PR_SET_PDEATHSIG``,
    kept across ``exec``), so a ``kill -9`` of ``unbroken run`` stops its trainer as a
    preemption would (save, exit 75) instead of leaving it training as an orphan that holds the
    run's lock. The supervisor forks from its only thread, the one that lives as long as it.
    ``idle``, ``oom``: a warm standby's ``SCHED_IDLE`` and ``oom_score_adj``; ``standby``: it
    starts with SIGINT ignored (kept across ``exec``; Python then installs no handler of its
    own): a Ctrl-C in the terminal while its interpreter starts -- before ``import unbroken``
    installs the stop handlers, which replace the disposition -- would otherwise end it in a
    ``KeyboardInterrupt`` traceback in the middle of the job's output."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    except (OSError, AttributeError):
        return None

    def child() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != supervisor:  # it died before the line above took effect
            os.kill(os.getpid(), signal.SIGTERM)
        if idle:
            # A warm standby: its set-up takes only CPU that training leaves (inherited by
            # the threads it starts; train/_as_standby.py puts every one back at its promotion).
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        if oom is not None:
            set_oom_score(0, oom)
        if standby:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    return child


OOM_STANDBY = 1000
"""The warm standby's ``oom_score_adj``: when memory runs out, the kernel kills it before
anything else of the job (the trainer keeps the supervisor's own score; raising one's own needs
no privilege, and one may lower it back to where it was: the supervisor does, at the
promotion)."""
OOM_PERSISTER = 500
"""The persister's (:mod:`._persister`): after the standby, before the trainer; the supervisor
persists a snapshot itself when its persister is gone."""


def oom_score(pid: int = 0) -> int | None:
    """``pid``'s ``oom_score_adj`` (0: this process); None where there is none (not Linux)."""
    try:
        with open(f"/proc/{pid or 'self'}/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def set_oom_score(pid: int, value: int) -> bool:
    """Set ``pid``'s ``oom_score_adj`` (0: this process); False where it could not be."""
    try:
        with open(f"/proc/{pid or 'self'}/oom_score_adj", "w") as f:
            f.write(str(value))
        return True
    except OSError:
        return False


def stop_area() -> str:
    """A directory for the stop markers of one supervisor's launches (removed by ``discard``)."""
    return tempfile.mkdtemp(prefix=f"unbroken-stops-{os.getpid()}-")


def discard(area: str) -> None:
    shutil.rmtree(area, ignore_errors=True)


class Launch:
    def __init__(
        self,
        cmd: list[str],
        env: dict[str, str],
        area: str,
        n: int,
        *,
        pass_fds: tuple[int, ...] = (),
        idle: bool = False,
        oom: int | None = None,
        standby: bool = False,
    ) -> None:
        """Start ``cmd`` as launch ``n`` (``pass_fds``, ``idle``, ``oom``, ``standby``: a warm
        standby's pipe, and its ``SCHED_IDLE`` and ``oom_score_adj`` until it is promoted, and
        its SIGINT ignored until unbroken's handlers exist; see :mod:`._standby`)."""
        self.tag = _tree.new_tag()
        self.stop_dir = os.path.join(area, f"attempt-{n}")
        # Anything there was left by a standby for this attempt that died before its promotion
        # (its stop marker, its crash record): not this launch's to be judged by.
        shutil.rmtree(self.stop_dir, ignore_errors=True)
        env = _protocol.launch_env(env, job_tag=self.tag, stop_dir=self.stop_dir)
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            pass_fds=pass_fds,
            preexec_fn=_follow(os.getpid(), idle, oom, standby),
        )
        self.tree = _tree.Tree(self.proc.pid, self.tag)
        # Whether a stop signal was forwarded only to processes with no handler for it (ranks
        # still importing): they died of it having trained nothing -- a stop, not a crash.
        self.unhandled: bool | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def forward(self, signum: int, terminal_pgrp: int | None) -> str:
        """Send a stop signal to the launch's processes that should get it; says what was done.
        ``terminal_pgrp``: the process group a terminal already delivered this Ctrl-C to."""
        name = _signame(signum)
        targets = self.tree.stop_targets(signum)
        handled = any(_tree.catches(p, signum) for p in targets)
        if targets and signum != signal.SIGHUP:  # SIGHUP is not a stop a trainer handles
            self.unhandled = not handled and self.unhandled is not False
        if not targets:
            return f"{name}: child already gone"  # the wait will tell how it ended
        sent = self.tree.send(signum, targets, terminal_pgrp)
        if terminal_pgrp is not None:
            if not sent:
                return f"{name}: sent by the terminal, not forwarded"
            return (
                f"{name}: sent by the terminal to CMD's process group; forwarded to "
                f"{_pids(sent)} outside it"
            )
        if not sent:
            return f"{name}: child already gone"
        if sent == [self.pid]:
            return f"{name}: forwarded"
        spared = _tree.agents(self.tree.members())
        but = f", not to the launcher {_pids(sorted(spared))}" if spared else ""
        return f"{name}: forwarded to {_pids(sent)}{but}"

    def settle(self, rc: int, grace: float) -> tuple[str | None, str]:
        """After CMD exited with ``rc``: wait for what it left running (at most ``grace``
        seconds, then SIGKILL), then read the stop markers. Returns (a description when every
        rank saved and stopped, else None; a note for the report)."""
        note = ""
        if rc != 0:
            left = self.tree.wait_gone(grace)
            if left:
                self.tree.send(signal.SIGKILL, left)
                note = f"killed {_pids(left)} left running {grace:g}s after CMD exited"
        return _stops.all_stopped(self.stop_dir), note

    def kill(self) -> None:
        self.tree.kill()


def _pids(pids: list[int]) -> str:
    return f"pid {pids[0]}" if len(pids) == 1 else "pids " + ", ".join(map(str, pids))


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
