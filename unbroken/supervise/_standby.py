"""The supervisor's warm standby: the next attempt, started early, waiting to take over.

A relaunch used to pay for a new process -- the interpreter, ``import torch, unbroken`` and the
script's own set-up before ``Run()`` -- before it could restore the snapshot. So once the
trainer of attempt *n* has opened its ``Run`` (the command is an unbroken script, and the
channel of the snapshot area says so), the supervisor starts attempt *n + 1* beside it: the
environment attempt *n + 1* will have, and a pipe (:data:`unbroken.process._protocol.STANDBY`). When
attempt *n* ends and the policy relaunches, the supervisor persists the snapshot as before,
writes "go", and adopts the waiting process as attempt *n + 1*; nothing in its environment
changes. The next standby starts once that one has trained (a snapshot committed since its
``Run`` opened): a process start during the first step after the restore would slow it.

How far it gets before it waits (``--standby``):

- ``imports``, the default (:mod:`._warm`): ``python [OPTIONS] SCRIPT ARGS`` rewritten so that
  the interpreter imports torch and unbroken, waits, and runs the script only when promoted.
  Nothing of the user's script runs anywhere but in the one process that trains.
- ``deep`` (``run``, its old name): the command itself, whose first ``Run()`` waits
  (:mod:`unbroken.train._as_standby`): the script's own set-up is saved too, but it runs beside
  the live trainer -- its side effects twice, its memory twice. It refuses (exits, leaving
  :data:`unbroken.process._stops.REFUSED`) when the script initialised CUDA before ``Run()``, and
  the supervisor keeps a shallow standby instead.

``torchrun --standalone`` gets a standby torchrun whose workers wait before the script
(:func:`._warm.torchrun_command`; the imports depth whatever ``--standby`` says, short of off):
with a private rendezvous it starts beside the live job without meeting it, and a worker that
waited before the script built no process group and touched no GPU. Their signal to go is a
FIFO in the stop area, held open by the supervisor from before the standby starts until the
launch it became has ended; at the promotion it gets :data:`GO` bytes, one per worker.

Off (the supervisor launches afresh, as without a standby) with ``--no-standby`` or
``UNBROKEN_STANDBY=0``, without a snapshot area, for a command the default depth cannot
rewrite, and for other launchers and multi-rank jobs (a standby rank would join the job's
rendezvous while it sets up; docs/design.md); :meth:`Standby.startup` says which and why. A
standby runs with a high ``oom_score_adj`` (the kernel kills it first when memory runs out) and
under ``SCHED_IDLE`` where that can be undone; both are put back at its promotion. One that died
on its own is noticed at the promotion and replaced by a fresh launch; at the end of
supervision it is killed with its whole tree (it never touched the run directory).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping

from ..process import _protocol, _shm, _stops, _tree
from . import _job, _warm

LAUNCHERS = frozenset(
    {"torchrun", "accelerate", "deepspeed", "mpirun", "mpiexec", "srun", "horovodrun"}
)
RANK_COUNTS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
UNSNAPPED = 10.0
"""Seconds after a ``Run`` opened when its standby starts though no snapshot came."""
GO = 4096
"""Bytes written to a standby torchrun's FIFO at its promotion: one per worker that reads it
(more than a node has workers; within ``PIPE_BUF``, so written at once)."""

IMPORTS, DEEP, OFF = "imports", "deep", "off"
"""How deep a standby gets before it waits: only through ``import torch, unbroken``, before the
script (the default, :mod:`._warm`), or into the script's first ``Run()``."""
DEPTHS = (IMPORTS, DEEP, "run", OFF)
"""``--standby``'s choices; ``run`` is the deep one's old name."""
_NAMES = {"0": OFF, OFF: OFF, IMPORTS: IMPORTS, DEEP: DEEP, "run": DEEP}

SHALLOW_TEXT = (
    "a python with torch and unbroken imported waits beside the trainer and runs the script "
    "only when it takes over: nothing of the script runs before that, so what it does before "
    "Run() happens once per attempt; --standby deep also runs the script's set-up early (its "
    "hazards: docs/supervise.md), --no-standby turns it off"
)
DEEP_TEXT = (
    "a second process of CMD runs the script up to its first Run() while the trainer trains, "
    "and waits there: what the script does before Run() happens twice, beside the live trainer "
    "-- its output, the files it writes or opens for writing (a log opened with mode 'w' is "
    "truncated under the trainer; a data file the trainer memory-maps, downloaded again, kills "
    "it with SIGBUS), and the memory it holds, twice (a model moved to the GPU: a second CUDA "
    "context -- if the script initialised CUDA before Run(), the standby refuses and a shallow "
    "one is kept instead); --no-standby turns it off"
)
TORCHRUN_TEXT = (
    "a second torchrun of CMD, whose workers wait with torch and unbroken imported and run the "
    "script only when they take over: nothing of the script runs before that; --no-standby "
    "turns it off"
)
NOT_PYTHON = (
    "CMD is not `python SCRIPT ...` or `python -m MODULE ...` (a shell script, `python -c`, a "
    "wrapper), so no standby can wait before its script; --standby deep would run the script's "
    "set-up beside the trainer instead (docs/supervise.md)"
)


def _chosen(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str]:
    """(the depth asked for, who asked: an option, the variable, or the default)."""
    if getattr(args, "no_standby", False):
        return OFF, "--no-standby"
    chosen = getattr(args, "standby", None)
    if chosen:
        return _NAMES.get(str(chosen), IMPORTS), f"--standby {chosen}"
    value = env.get(_protocol.STANDBY, "")
    if value in _NAMES:
        return _NAMES[value], f"{_protocol.STANDBY}={value}"
    return IMPORTS, "the default"


def depth(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """``--standby`` (``--no-standby``: off), else ``UNBROKEN_STANDBY`` (0: off), else imports."""
    return _chosen(args, env)[0]


def off_reason(
    args: argparse.Namespace, cmd: list[str], env: Mapping[str, str], snapshots: bool
) -> str | None:
    """Why a job gets no standby, from the options, command and environment (None: it does)."""
    chosen, who = _chosen(args, env)
    if chosen == OFF:
        return who
    if not snapshots:
        # The standby would resume from an older durable checkpoint.
        return "no in-memory snapshots (a standby would resume from an older durable checkpoint)"
    if _warm.torchrun_command(cmd, env) is not None:
        if chosen == DEEP:
            return (
                f"{who} cannot wait inside torchrun's ranks (each would hold a second copy of "
                "the model on the job's GPUs); the default waits before the script"
            )
        return None  # a standby torchrun, its workers at the imports depth
    words = [os.path.basename(w) for w in cmd[:3]]
    if LAUNCHERS & set(words) or {"torch.distributed.run", "torch.distributed.launch"} & set(cmd):
        if {"torchrun", "torch.distributed.run"} & {*words, *cmd}:
            return (
                "CMD is torchrun without --standalone (a shared rendezvous, which a standby "
                "agent would join as a node) or with options this cannot rewrite"
            )
        return "CMD is a launcher: a standby rank would join the job's rendezvous"
    for name in RANK_COUNTS:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 1:
            return f"{name}={value}: one rank of several"
    if chosen == IMPORTS and _warm.command(cmd) is None:
        return NOT_PYTHON
    return None


def _several_ranks(launch: _job.Launch) -> bool:
    """Whether the launch turned out to run ranks (a launcher behind a wrapper script)."""
    members = launch.tree.members()
    if _tree.agents(members):
        return True
    for pid in members:
        for var in _tree._environ(pid).split(b"\0"):
            name, _, value = var.partition(b"=")
            if name.decode(errors="replace") in RANK_COUNTS and value.isdigit():
                if int(value) > 1:
                    return True
    return False


def idle_undoable() -> bool:
    """Whether this process's children may enter ``SCHED_IDLE`` and leave it again (root with
    CAP_SYS_NICE, or RLIMIT_NICE >= 20; the default limit 0 forbids the way back, and a
    trainer stuck in SCHED_IDLE would starve). Tried in a thread of its own, which then ends."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    ok: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="unbroken-sched-probe")
    t.start()
    t.join()
    return bool(ok)


class Standby:
    """At most one waiting process, for the next attempt."""

    def __init__(
        self,
        args: argparse.Namespace,
        cmd: list[str],
        stops: str,
        area: _shm.SupervisorArea | None,
        say: Callable[[str], None],
    ) -> None:
        self.cmd, self.stops, self.area = cmd, stops, area
        self.say = (lambda _: None) if args.quiet else say
        self.off = off_reason(args, cmd, os.environ, area is not None)
        self.depth, self.who = _chosen(args, os.environ)
        # What the standby runs: CMD itself, or CMD rewritten to wait before its script.
        self.torchrun = _warm.torchrun_command(cmd, os.environ)
        if self.torchrun is not None:
            self.depth = IMPORTS
        shallow = self.torchrun or (_warm.command(cmd) if self.depth == IMPORTS else None)
        self.argv = shallow or cmd
        self.spare: _job.Launch | None = None
        self.pipe: int | None = None  # the write end; closed = EOF = "the supervisor is gone"
        self.fifo: str | None = None  # a standby torchrun's FIFO (its path) instead of a pipe
        # The promoted standby torchrun's FIFO, held open until its launch has ended: a worker
        # still importing at the promotion opens it later, and must find a writer and a byte.
        self.held: tuple[int, str] | None = None
        self.attempt = 0  # the attempt the spare is for
        self.idle: bool | None = None  # SCHED_IDLE while it sets up (probed once)
        # Its oom_score_adj while it waits: above the supervisor's own (the trainer's), which
        # it gets back at the promotion.
        self.oom = _job.oom_score()
        self.lifting: _job.Launch | None = None  # promoted, not yet trained: put back

    def startup(self) -> str:
        """What the supervisor says at start-up: which standby, or why none."""
        if self.off is not None:
            return f"no warm standby: {self.off}"
        if self.torchrun is not None:
            return f"warm standby: {TORCHRUN_TEXT}"
        if self.depth == IMPORTS:
            return f"warm standby: shallow ({self.who}) -- {SHALLOW_TEXT}"
        return f"warm standby: deep ({self.who}) -- {DEEP_TEXT}"

    def mark(self) -> int:
        """The channel's modification time now (-1: none), taken before an attempt starts:
        the attempt's ``Run`` opening rewrites the channel, which moves it past the mark.

        A mark, not the supervisor's clock: a file's times come from the kernel's coarse clock,
        which lags ``time.time_ns()`` by up to a tick (4 ms). A standby promoted at once wrote
        the channel 0.4 ms "before" the attempt started, and the next standby never came."""
        if self.area is None:
            return -1
        try:
            return os.stat(self.area.channel).st_mtime_ns
        except OSError:
            return -1

    def wait(self, launch: _job.Launch, n: int, mark: int, stopping: Callable[[], bool]) -> int:
        """Wait for launch ``n`` to end (its ``Popen.wait`` code); start the spare for attempt
        ``n + 1`` once the launch opened its ``Run`` (moved the channel past :meth:`mark`),
        unless the supervisor is ``stopping`` (nothing will be relaunched)."""
        proc = launch.proc
        while self.off is None and (
            self.spare is None or self.lifting is launch or self.depth == DEEP
        ):
            try:
                return proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            opened = self._run_opened(mark)
            if self.lifting is launch:
                # Again on every look until it trained: the lift at the promotion misses a
                # process forked while it read the process table (or a thread started
                # meanwhile), and one left importing torch on idle time takes minutes on a
                # busy machine while the job's other ranks wait for it (seen on CI).
                self._put_back(launch)
                if opened:
                    self.lifting = None
            if self.spare is not None:
                self._refused()
            elif not stopping() and opened:
                if self.torchrun is None and _several_ranks(launch):
                    self.off = "the job runs several ranks"
                    self.say(f"no warm standby from here on: {self.off}")
                else:
                    self._start(n + 1)
        return proc.wait()

    def _put_back(self, launch: _job.Launch) -> None:
        """A promoted standby's processes back to the trainer's priority and OOM score."""
        members = launch.tree.members()
        if self.idle:
            _normal_priority(members)
        if self.oom is not None:
            for pid in members:
                if _job.oom_score(pid) not in (None, self.oom):
                    _job.set_oom_score(pid, self.oom)

    def _refused(self) -> None:
        """A deep standby that exited at its wait point because the script had initialised
        CUDA (train/_as_standby.py), or whose script failed before it got there (a set-up that
        cannot run twice: a fixed port bound, _stops.record_uncaught): keep a shallow one
        instead, at once, and say why in one line (the standby printed no traceback)."""
        spare = self.spare
        if spare is None or self.depth != DEEP or spare.proc.poll() is None:
            return
        why = _stops.refusal(spare.stop_dir)
        if why is None:
            return  # died otherwise: replaced by a fresh launch at the promotion
        pipe, fifo = self.pipe, self.fifo
        self.spare = self.pipe = self.fifo = None
        if pipe is not None:
            _end(spare, pipe, fifo)  # (whatever it started goes with it)
        self._fall_back(why)
        if self.off is None:
            self._start(self.attempt)

    def _fall_back(self, why: str) -> None:
        self.depth = IMPORTS
        shallow = _warm.command(self.cmd)
        if shallow is None:
            said = why if why.startswith(_stops.FAILED) else f"refused ({why})"
            self.off = f"the deep standby {said}, and {NOT_PYTHON}"
            self.say(f"no warm standby from here on: {self.off}")
            return
        self.argv = shallow
        said = why if why.startswith(_stops.FAILED) else f"refused: {why}"
        self.say(
            f"the deep standby {said}; a shallow standby instead (a python with torch "
            "and unbroken imported, waiting before the script: nothing of it runs before its "
            "turn)"
        )

    def _run_opened(self, mark: int) -> bool:
        """The launch opened its ``Run`` (it wrote the channel: newer than ``mark``) and then
        trained: a snapshot committed since, or :data:`UNSNAPPED` seconds passed (a trainer
        that takes none). Not at once: a process start during the first step after a
        restore slowed that step by ~0.5 s (performance.md), even under SCHED_IDLE."""
        assert self.area is not None
        try:
            st = os.stat(self.area.channel)
        except OSError:
            return False
        if st.st_size == 0 or st.st_mtime_ns <= mark:
            return False
        if time.time_ns() - st.st_mtime_ns > UNSNAPPED * 1e9:
            return True
        snaps = os.path.join(self.area.path, "checkpoints")  # (store/_layout.py)
        try:
            names = [n for n in os.listdir(snaps) if n.startswith("step-")]
            return any(os.stat(os.path.join(snaps, n)).st_mtime_ns > st.st_mtime_ns for n in names)
        except OSError:
            return False

    def _start(self, n: int) -> None:
        assert self.area is not None
        if self.idle is None:
            self.idle = idle_undoable()
        env = _protocol.supervised_env(os.environ, attempt=n, snapshot_dir=self.area.path)
        fds: tuple[int, ...] = ()
        try:
            if self.torchrun is not None:
                fifo = os.path.join(self.stops, f"standby-{n}-{os.urandom(4).hex()}.fifo")
                os.mkfifo(fifo, 0o600)  # in the supervisor's own 0700 directory
                r, w = -1, os.open(fifo, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                env[_protocol.STANDBY] = fifo
            else:
                fifo = None
                r, w = os.pipe()  # not inheritable (PEP 446): only the spare gets r
                fds, env[_protocol.STANDBY] = (r,), str(r)
        except OSError as e:
            self.off = f"could not start one: {e}"
            return
        oom = _job.OOM_STANDBY if self.oom is not None and self.oom < _job.OOM_STANDBY else None
        try:
            spare = _job.Launch(
                self.argv, env, self.stops, n, pass_fds=fds, idle=self.idle, oom=oom, standby=True
            )
        except OSError as e:
            _close(w, fifo)
            self.off = f"could not start one: {e}"
            return
        finally:
            if r >= 0:
                os.close(r)
        self.spare, self.pipe, self.fifo, self.attempt = spare, w, fifo, n

    def take(self, n: int) -> tuple[_job.Launch | None, str]:
        """Promote the spare to attempt ``n`` (after the snapshot was persisted): the launch,
        or None when there is none to promote (launch afresh); and a note for the report."""
        self._release()  # the launch it was held for has ended
        spare, pipe, fifo = self.spare, self.pipe, self.fifo
        self.spare = self.pipe = self.fifo = None
        if spare is None or pipe is None:
            return None, ""
        code = spare.proc.poll()
        if self.attempt == n and code is None:
            self._put_back(spare)  # it may still be setting up
            self.lifting = spare  # and again until it trained (wait)
            try:
                os.write(pipe, b"g" * (GO if fifo else 1))
            except OSError:
                code = spare.proc.poll()
            else:
                if fifo is None:
                    os.close(pipe)
                else:
                    self.held = (pipe, fifo)
                return spare, f"from the warm standby (pid {spare.pid})"
        _end(spare, pipe, fifo)
        if code is None:
            return None, ""
        why = _stops.refusal(spare.stop_dir) if self.depth == DEEP else None
        if why is not None:
            self._fall_back(why)
            return None, "the deep standby had refused: launched afresh"
        return None, f"the warm standby had exited ({_code(code)}): launched afresh"

    def close(self) -> None:
        """Kill the spare, if any, with its whole tree (it never touched the run directory)."""
        self._release()
        spare, pipe, fifo = self.spare, self.pipe, self.fifo
        self.spare = self.pipe = self.fifo = None
        if spare is not None and pipe is not None:
            _end(spare, pipe, fifo)

    def _release(self) -> None:
        if self.held is not None:
            _close(*self.held)
            self.held = None


def _normal_priority(pids: list[int]) -> None:
    """Every thread of ``pids`` from ``SCHED_IDLE`` back to ``SCHED_OTHER``: a standby promoted
    while still setting up must not finish it on idle time (the machine may be busy with
    others' work). The standby does the same for itself in ``Run()`` (train/_as_standby.py).
    Until the promoted launch trained, a process of it that entered ``SCHED_IDLE`` on its own
    is lifted too: a brief window, and a trainer's set-up is no place for idle time."""
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass  # a thread that ended meanwhile


def _end(spare: _job.Launch, pipe: int, fifo: str | None) -> None:
    spare.kill()
    spare.proc.wait()
    _close(pipe, fifo)


def _close(fd: int, fifo: str | None) -> None:
    """The write end closed (EOF for every reader: the supervisor is done with it) and the
    FIFO, if any, removed (a worker that opens it after that exits, see train/_as_standby.py)."""
    os.close(fd)
    if fifo is not None:
        try:
            os.unlink(fifo)
        except OSError:
            pass


def _code(code: int) -> str:
    return f"killed by {_job._signame(-code)}" if code < 0 else f"exit {code}"
