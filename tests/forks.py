"""Launch a test's training scripts without paying torch's import each time.

Most of the suite's time went to start-ups: a Python process that imports torch and the part
of it unbroken saves through costs ~3 s of CPU on this machine, and a golden test starts 4-6 of
them per case (times the ranks in a distributed one). ``launch`` forks each launch from a fork
server that imported them once (unbroken/verify/_forkserver.py, what ``unbroken verify`` forks
its relaunches from): each launch is still a new process of its own (its own pid and session,
its own exit status, signalled and killed for real), whose only link to an earlier one is the
run directory; the server never ran a script, so a fork holds no training state, and it imports
unbroken afresh. What a fork does not repeat is the interpreter's start-up: the suite keeps
tests that start real processes (the CLI, ``unbroken run``, torchrun, ``python -c``), and
``UNBROKEN_TEST_FORKS=0`` makes every launch here a new process too.

Settings read when torch is imported (the OpenMP thread count) are the server's: launches are
grouped by ``OMP_NUM_THREADS``, one server per value, so a rank started with 1 thread gets 1.
A script importing a framework (Lightning, transformers: seconds more) gets a server that
imported it too (``preloads``), one per rank, as Lightning reads the rank when imported.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.verify._forkserver import ForkedProcess, ForkServer, preloads

ROOT = Path(__file__).resolve().parent.parent
_servers: dict[tuple[object, ...], ForkServer | None] = {}
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
_lock = threading.Lock()
_logs = tempfile.mkdtemp(prefix="unbroken-test-forks-")


def enabled() -> bool:
    return os.environ.get("UNBROKEN_TEST_FORKS", "1") != "0"


def _server(script: str, args: Sequence[str], env: Mapping[str, str]) -> ForkServer | None:
    # A wrapper (tests/scripts/interrupt.py SCRIPT ...) runs the script named after it.
    wrapped = args[0] if args and str(args[0]).endswith(".py") else None
    preload = tuple(preloads(script) + (preloads(wrapped) if wrapped else []))
    # A framework imported by the server reads the rank from the environment then (Lightning's
    # rank_zero_only): those servers are per rank too.
    ranks = tuple(env.get(k) for k in _RANK_VARS) if preload else ()
    key = (env.get("OMP_NUM_THREADS"), preload, ranks)
    with _lock:
        if key not in _servers:
            base = {
                k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", *_RANK_VARS)
            }
            base.update({k: v for k, v in zip(_RANK_VARS, ranks, strict=False) if v is not None})
            if key[0] is not None:
                base["OMP_NUM_THREADS"] = key[0]
            base["PYTHONPATH"] = str(ROOT)
            log = os.path.join(_logs, f"server-{len(_servers)}.log")
            server = ForkServer(sys.executable, base, log, preload)
            _servers[key] = server if server.ready(180) else None
            if _servers[key] is None:
                server.close()
        return _servers[key]


@atexit.register
def _close() -> None:
    for server in _servers.values():
        if server is not None:
            server.close()
    shutil.rmtree(_logs, ignore_errors=True)


class Hung(subprocess.TimeoutExpired):
    """A launch past its time; ``text``: what it wrote, its stacks at the end."""

    def __init__(self, cmd: Any, timeout: float, text: str) -> None:
        super().__init__(cmd, timeout)
        self.text = text


@dataclass
class Launch:
    """One started launch: ``wait`` returns its exit code (negative: the signal that ended it)
    and what it wrote to stdout and stderr, together when it was forked."""

    proc: subprocess.Popen[str] | ForkedProcess
    log: str | None

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """Its exit code and output; past ``timeout`` it is aborted (every thread's stack
        written to its stderr where it runs with ``PYTHONFAULTHANDLER``), killed, and
        :class:`Hung` carries what it wrote: a hang is shown where it hangs."""
        try:
            if isinstance(self.proc, subprocess.Popen):
                out, err = self.proc.communicate(timeout=timeout)
                return int(self.proc.returncode), out, err
            code = int(self.proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired as e:
            raise Hung(e.cmd, timeout, self.abort()) from None
        return code, "", self._read_log()

    def _read_log(self) -> str:
        assert self.log is not None  # a forked launch writes both streams to its log
        with open(self.log, errors="replace") as f:
            text = f.read()
        os.unlink(self.log)
        return text

    def abort(self, grace: float = 15.0) -> str:
        """SIGABRT (the stacks, through faulthandler), then SIGKILL; what it wrote."""
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGABRT)
        try:
            if isinstance(self.proc, subprocess.Popen):
                return self.proc.communicate(timeout=grace)[1] or ""
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()
            if isinstance(self.proc, subprocess.Popen):
                return self.proc.communicate()[1] or ""
        self.kill()  # what it left in its session
        return self._read_log()

    def kill(self) -> None:
        try:
            if isinstance(self.proc, subprocess.Popen):
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
            else:
                os.killpg(self.pid, signal.SIGKILL)  # a fork leads its own session
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass


def start(
    script: str | Path, args: Sequence[str], env: Mapping[str, str], cwd: str | Path | None = None
) -> Launch:
    """``python SCRIPT ARGS`` in ``env`` (and ``cwd``): forked where it can be, else a new
    process."""
    argv = [sys.executable, str(script), *args]
    where = str(cwd) if cwd is not None else os.getcwd()
    server = _server(str(script), args, env) if enabled() and str(script).endswith(".py") else None
    if server is not None:
        fd, log = tempfile.mkstemp(suffix=".log", dir=_logs)
        os.close(fd)
        return Launch(server.spawn(argv, env, where, log), log)
    proc = subprocess.Popen(
        argv, env=dict(env), cwd=where, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return Launch(proc, None)
