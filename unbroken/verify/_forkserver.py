"""Relaunches without the start-up: a Python interpreter that imported torch (numpy, torch's
distributed checkpointing, and torch._dynamo, which a torch optimizer imports) once, then forks
a fresh child per launch, which runs the user's script as ``python SCRIPT ARGS`` would
(``runpy``, ``__main__``, ``sys.argv``, the launch's environment, its own session).

Why a fork is an honest relaunch for ``unbroken verify``: the server never runs the script, so
a child starts with no training state at all -- whatever it trains on comes from the run
directory's checkpoint, exactly as for a new process. What a child shares with its siblings
and not with a new interpreter is reset or left out: Python's and NumPy's global random
streams, and torch's default generator, are reseeded from the OS, as a new interpreter seeds
them; ``hash()``
of a string keeps the server's seed, which differs from the reference run's (a new process:
_runner), so a script that depends on it still shows up. unbroken itself is not imported by the
server (its import is cheap, and it keeps per-process state from its import: the process that
owns the stop signals, say), so each child imports it afresh. verify's comparison runs in a child
too (``python -m unbroken.verify._compare_job``, with verify's unbroken first on ``sys.path``:
the request's ``path``), so that verify itself never imports torch.

Only ``python SCRIPT.py ...`` and ``python -m MODULE ...`` (optionally ``-u``) can be forked
(:func:`forkable`); anything else (torchrun, a shell wrapper, other interpreter options) is
launched as a process every time. The server refuses to fork (and every launch is a process)
if importing left it with a Python thread besides the main one: a fork copies only the calling
thread. Native pools (OpenBLAS's, started by importing numpy) reset themselves in the child
(their pthread_atfork handlers), as they do for every forked DataLoader worker.

Protocol: JSON lines. To the server (stdin): ``{"argv", "env", "cwd", "log", "target",
"module", "unbuffered", "path"}``; from it (stdout): ``{"pid": N}`` once forked, ``{"exit": N,
"code": C}`` when a child ended (``C`` as ``Popen.returncode``: negative for a signal),
``{"error": TEXT}``. It exits at EOF on stdin (verify ended), killing children it still has.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO, Any

_PYTHON = re.compile(r"python(\d+(\.\d+)*)?$")
# Frameworks whose import costs seconds more than torch's (Lightning's ~5-10 s on 2 cores,
# transformers' and accelerate's ~2-3 s): a script that imports one at its top gets it
# imported by the server too, so that a fork skips it. Only these: importing a module runs its
# code, and these do nothing at import that a child would need to see again (a script's own
# modules, which might, are never imported by the server).
FRAMEWORKS = ("accelerate", "datasets", "lightning", "pytorch_lightning", "transformers")


def forkable(argv: Sequence[str]) -> tuple[str, bool, list[str]] | None:
    """``(target, is_module, script args)`` for ``python [-u] SCRIPT ARGS`` or ``python [-u] -m
    MODULE ARGS``; None for any other command (launched as a process every time)."""
    if len(argv) < 2 or not _PYTHON.match(os.path.basename(argv[0])):
        return None
    rest = list(argv[1:])
    if rest and rest[0] == "-u":
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m" and not rest[1].startswith("-"):
        return rest[1], True, rest[2:]
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return rest[0], False, rest[1:]
    return None


_PARSING = threading.Lock()


def preloads(script: str) -> list[str]:
    """What the server imports for ``python SCRIPT``: the :data:`FRAMEWORKS` modules the script
    imports at its top level (``import X``, ``from X import a, b``; as ``"X"`` and ``"X:a,b"``,
    the names fetched too, as a lazy package like transformers loads them only then).
    Empty for a file that cannot be read or parsed: the script itself will say why."""
    import ast

    try:
        with open(script, "rb") as f:
            source = f.read()
        # One parse at a time: CPython 3.11's AST constructor keeps its recursion depth per
        # interpreter, and two threads parsing at once (verify_resume called from a thread
        # pool) fail with "SystemError: AST constructor recursion depth mismatch".
        with _PARSING:
            tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return []
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] in FRAMEWORKS]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in FRAMEWORKS:
                names = [a.name for a in node.names if a.name != "*"]
                out.append(f"{node.module}:{','.join(names)}" if names else node.module)
    return out


class ForkedProcess:
    """A child of the fork server, with what verify uses of ``subprocess.Popen``."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.code(self.pid, wait=True, timeout=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.returncode = code
        return code


class ForkServer:
    """The client side: start the server with the command's own interpreter, then
    :meth:`spawn` a child per launch. Thread-safe."""

    def __init__(
        self, python: str, env: Mapping[str, str], log_path: str, preload: Sequence[str] = ()
    ) -> None:
        self._log = open(log_path, "ab")
        self._proc = subprocess.Popen(
            # by path: the server imports no unbroken
            [python, os.path.abspath(__file__), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=dict(env),
            start_new_session=True,  # a Ctrl-C to verify is verify's to handle
        )
        self._cond = threading.Condition()
        self._codes: dict[int, int] = {}
        self._started: list[dict[str, Any]] = []
        self._gone = False
        self._ready: bool | None = None
        self._said_ready: bool | None = None  # what the server said once it imported
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="unbroken-forkserver", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                if "exit" in msg:
                    self._codes[int(msg["exit"])] = int(msg["code"])
                elif "ready" in msg:
                    # Kept apart from the forks' answers: with the server shared between
                    # verifications (shared()), a thread still asking whether it is ready
                    # took the answer to another thread's fork, which then waited 60 s.
                    self._said_ready = msg["ready"] is True
                else:
                    self._started.append(msg)
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def ready(self, timeout: float) -> bool:
        """The server imported everything and can fork (False: it cannot, or did not say so
        in ``timeout`` seconds; launches are processes then)."""
        with self._cond:
            if self._ready is None:
                self._cond.wait_for(lambda: self._said_ready is not None or self._gone, timeout)
                self._ready = self._said_ready is True
            return self._ready

    def spawn(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        log_path: str,
        path: Sequence[str] = (),
    ) -> ForkedProcess:
        """Fork a child that runs ``argv`` (a :func:`forkable` command); ``path`` goes before
        the child's ``sys.path`` (verify's own comparison job: verify's unbroken)."""
        parsed = forkable(argv)
        if parsed is None:
            raise ValueError(f"not a command the fork server runs: {argv!r}")
        target, module, args = parsed
        request = {
            "argv": [target, *args],
            "target": target if module else os.path.abspath(os.path.join(cwd, target)),
            "module": module,
            "env": dict(env),
            "cwd": cwd,
            "log": log_path,
            "unbuffered": "-u" in argv[1:2],
            "path": list(path),
        }
        with self._send_lock:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except OSError as e:
                raise OSError(f"the fork server is gone: {e}") from e
            with self._cond:
                self._cond.wait_for(lambda: self._started or self._gone, 60)
                if not self._started:
                    raise OSError("the fork server did not fork (see forkserver.log)")
                msg = self._started.pop(0)
        if "pid" not in msg:
            raise OSError(f"the fork server could not fork: {msg.get('error')}")
        return ForkedProcess(self, int(msg["pid"]), list(argv))

    def code(self, pid: int, *, wait: bool = False, timeout: float | None = None) -> int | None:
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: pid in self._codes or self._gone, timeout)
            if pid in self._codes:
                return self._codes[pid]
            if self._gone:
                return -signal.SIGKILL  # the server died: its children were killed with it
            return None

    def close(self) -> None:
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


_shared: dict[tuple[str, str | None, tuple[str, ...]], ForkServer] | None = None
_shared_lock = threading.Lock()


@contextmanager
def shared() -> Iterator[None]:
    """Within the block, every ``verify_resume`` of this process forks from one server per
    interpreter, OpenMP thread count and preloaded frameworks, closed when the block ends,
    instead of starting (and importing torch in) a server of its own: for a caller that
    verifies many scripts, such as the project's tests. Each reference run is still a new
    process, and a child's environment is its own launch's (only what torch reads when it is
    imported is the first caller's)."""
    global _shared
    with _shared_lock:
        outer, _shared = _shared, ({} if _shared is None else _shared)
    try:
        yield
    finally:
        if outer is None:
            with _shared_lock:
                servers, _shared = list((_shared or {}).values()), None
            for server in servers:
                server.close()


def server_for(
    python: str, env: Mapping[str, str], log_path: str, preload: Sequence[str]
) -> tuple[ForkServer, bool]:
    """A fork server for one verification, and whether the caller owns it (closes it):
    inside :func:`shared`, the one already started for the same interpreter, thread count
    and preloads."""
    key = (python, env.get("OMP_NUM_THREADS"), tuple(preload))
    with _shared_lock:
        if _shared is None:
            return ForkServer(python, env, log_path, preload), True
        if key not in _shared:
            _shared[key] = ForkServer(python, env, log_path, preload)
        return _shared[key], False


# ---- the server (python -m unbroken.verify._forkserver) ------------------------------------------


def _child(req: dict[str, Any], out: IO[bytes]) -> None:
    """In the forked child: become the launch, run the script, exit with its status."""
    code = 1
    try:
        os.setsid()
        out.close()
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        if os.environ.get("PYTHONFAULTHANDLER"):
            faulthandler.enable()  # what a new interpreter does with it
        os.chdir(req["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if req.get("unbuffered"):
            sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
            sys.stderr.reconfigure(write_through=True)  # type: ignore[union-attr]
        # A new interpreter seeds these from the OS (torch's default generator too, in this
        # torch); a fork would share the server's state.
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules:
            sys.modules["torch"].seed()
        import runpy

        sys.argv = list(req["argv"])
        if req["module"]:
            sys.path.insert(0, os.getcwd())  # as `python -m` does (the server popped its own)
            sys.path[:0] = req.get("path", [])
            runpy.run_module(req["target"], run_name="__main__", alter_sys=True)
        else:
            sys.argv[0] = req["target"]
            sys.path.insert(0, os.path.dirname(req["target"]))  # as `python SCRIPT` does
            runpy.run_path(req["target"], run_name="__main__")
        code = 0
    except SystemExit as e:
        c = e.code
        code = c if isinstance(c, int) else (0 if c is None else 1)
        if not isinstance(c, int) and c is not None:
            print(c, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            # What interpreter shutdown does (join the threads the script left, then the
            # exit functions), short of the parts a fork must not repeat.
            import atexit

            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def serve(preload: Sequence[str] = ()) -> None:
    import importlib
    import select

    # Started by path: sys.path[0] is this package's directory, whose modules must not
    # shadow anything the imports below (or a child) look for.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    # What takes the time of a start-up: torch, the part of it unbroken's Run loads
    # (distributed checkpointing: a third of the rest), and torch._dynamo, which every torch
    # optimizer's constructor imports (a second; 3/4 of a forked relaunch's start without it).
    # The script's other imports are its own.
    import torch  # noqa: F401

    for name in ("numpy", "torch.distributed.checkpoint", "torch._dynamo"):
        try:
            __import__(name)
        except ImportError:
            pass
    for item in preload:  # preloads(): "module" or "module:name,name"
        name, _, attrs = item.partition(":")
        if name.split(".")[0] not in FRAMEWORKS:
            continue
        try:
            module = importlib.import_module(name)
            for attr in filter(None, attrs.split(",")):
                getattr(module, attr, None)
        except Exception:  # the script's own import will raise it, in the child
            pass

    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints of the imports go to the server's log, not the protocol

    def say(msg: dict[str, Any]) -> None:
        out.write((json.dumps(msg) + "\n").encode())

    threads = threading.active_count()
    if threads != 1:
        say({"ready": False, "error": f"{threads} Python threads after the imports: no forks"})
        return
    say({"ready": True})
    children: set[int] = set()
    stdin = sys.stdin.buffer
    buf = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.005)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                req = json.loads(line)
            except ValueError:
                continue
            try:
                pid = os.fork()
            except OSError as e:
                say({"error": str(e)})
                continue
            if pid == 0:
                _child(req, out)
            children.add(pid)
            say({"pid": pid})
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    # Verify waits for this exit: skip the teardown of an interpreter that imported torch
    # (about a second, more on a busy machine), which has nothing left to write.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    serve(sys.argv[1:])
