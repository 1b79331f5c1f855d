"""A launched job as a tree of processes: find them, signal them as a scheduler does, kill them.

Torch-free, Linux ``/proc`` (elsewhere a job is its one process). Why not a process group:
``torchrun`` starts every rank in a session of its own, so a signal to the launcher's group
never reaches a rank, and ``kill -9`` of the launcher leaves its ranks running. A job here is

- while its first process lives: that process and everything below it (``ppid`` links);
- afterwards: every process still carrying the job's tag
  (:data:`unbroken.process._protocol.JOB_TAG`) in its environment (inherited by everything it
  started), wherever it was reparented to.

A stop signal goes to the first process, to every process of the tree that handles the signal,
and to the workers of a launcher agent -- but not to the agent itself: torchrun dies of SIGUSR1
(it does not handle it), and on SIGTERM it kills its ranks 30 s later (``--shutdown-timeout``),
which may be before a large checkpoint is written. Its ranks stop on their own signal, exit 75,
and the agent exits after them. (``unbroken verify`` sends its signals to every process of
the job, agents included, as a scheduler's preemption does.)
"""

from __future__ import annotations

import os
import signal
import time
import uuid

from . import _protocol

TAG_ENV = _protocol.JOB_TAG
AGENT_CHILD_ENV = f"{_protocol.TORCHRUN_CHILD}=".encode()


def new_tag() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of ``pid``, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[2])


def _all_pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Running: a zombie has stopped (it waits to be reaped by its parent)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(root: int) -> list[int]:
    """``root``'s living descendants (not ``root``), parents before children."""
    kids: dict[int, list[int]] = {}
    for pid in _all_pids():
        st = _stat(pid)
        if st is not None and st[0] not in ("Z", "X"):
            kids.setdefault(st[1], []).append(pid)
    out, todo = [], list(kids.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def children(pid: int) -> list[int]:
    """``pid``'s children as the kernel lists them (exiting ones included), [] if gone: the
    direct children of a supervisor or a launcher, where :func:`descendants` is the subtree."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def cmdline(pid: int) -> bytes:
    """``pid``'s command line, NUL-separated; empty for a zombie, or once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def environ_value(pid: int, name: str) -> bytes | None:
    """``name`` in the environment ``pid`` was started with (None: unset, or unreadable, say
    while it is in the middle of ``exec``)."""
    prefix = f"{name}=".encode()
    for var in _environ(pid).split(b"\0"):
        if var.startswith(prefix):
            return var[len(prefix) :]
    return None


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def tagged(tag: str) -> list[int]:
    """The living processes (other than this one) whose environment carries ``tag``.

    A process in the middle of ``exec`` reads with an empty environment for a moment (the
    kernel sets it up after the parent's ``Popen`` has returned), so one scan can miss a child
    started just now: callers that must find everything scan again (:meth:`Tree.kill`)."""
    needle = f"{TAG_ENV}={tag}\0".encode()
    me = os.getpid()
    return [p for p in _all_pids() if p != me and needle in _environ(p) and alive(p)]


def catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (``SigCgt`` in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _parent(pid: int) -> int:
    st = _stat(pid)
    return st[1] if st else 0


def agents(pids: list[int]) -> set[int]:
    """Of ``pids``, the launcher agents: parents of torchrun workers, not workers themselves."""
    found = set()
    for pid in pids:
        env = _environ(pid)
        if AGENT_CHILD_ENV in env:
            parent = _parent(pid)
            if parent and AGENT_CHILD_ENV not in _environ(parent):
                found.add(parent)
    return found


class Tree:
    """The processes of one launched job (see the module docstring)."""

    def __init__(self, root: int, tag: str) -> None:
        self.root, self.tag = root, tag

    def members(self) -> list[int]:
        if alive(self.root):
            return [self.root, *descendants(self.root)]
        return tagged(self.tag)

    def stop_targets(self, sig: int) -> list[int]:
        """Who gets a stop signal: the first process (unless it is an agent), every process
        that handles ``sig`` (unless an agent), and every agent's workers (ranks still starting
        have no handler yet: they die of it, having trained nothing)."""
        members = self.members()
        skip = agents(members)
        workers = {p for p in members if _parent(p) in skip}
        return [
            p
            for p in members
            if p not in skip and (p == self.root or p in workers or catches(p, sig))
        ]

    def send(self, sig: int, pids: list[int], spare_pgrp: int | None = None) -> list[int]:
        """Signal ``pids`` (except those in process group ``spare_pgrp``); returns who got it."""
        sent = []
        for pid in pids:
            st = _stat(pid)
            if st is None or (spare_pgrp is not None and st[2] == spare_pgrp):
                continue
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                continue
            sent.append(pid)
        return sent

    def kill(self) -> None:
        """SIGKILL every process of the job, as a scheduler ends a job: the tree and anything
        tagged, again until nothing is left (a process may fork while we go)."""
        # First what needs no scan of /proc, at once: the first process and its process group
        # (verify aims some kills inside a save that may last a few milliseconds).
        try:
            if os.getpgid(self.root) == self.root:
                os.killpg(self.root, signal.SIGKILL)
            os.kill(self.root, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        # Until nothing is left, or 5 s: on a loaded machine a killed process can take longer
        # than the 0.5 s this once waited to stop being "running" (a flaky test showed it).
        deadline = time.monotonic() + 5.0
        while True:
            pids = set(self.members()) | set(tagged(self.tag))
            pids.discard(os.getpid())
            pids = {p for p in pids if alive(p)}
            if not pids or time.monotonic() >= deadline:
                return
            self.send(signal.SIGKILL, sorted(pids))
            time.sleep(0.01)

    def ranks_left(self) -> list[int]:
        """The job's launcher workers still alive (torchrun's ranks and their DataLoader
        workers), wherever they were reparented. Other leftovers (a daemon the command started
        on purpose) are not waited for: they are not training."""
        return [p for p in tagged(self.tag) if AGENT_CHILD_ENV in _environ(p)]

    def wait_gone(self, timeout: float | None, poll: float = 0.05) -> list[int]:
        """Wait until no rank of the job is left (``ranks_left``), at most ``timeout`` seconds
        (None: forever); returns those still alive."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = self.ranks_left()
            if not left or (deadline is not None and time.monotonic() >= deadline):
                return left
            time.sleep(poll)
