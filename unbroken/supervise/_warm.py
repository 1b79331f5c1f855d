"""The shallow warm standby, ``unbroken run``'s default: a Python interpreter that has imported
torch and unbroken, waiting to run the script.

The deep standby (``--standby deep``, :mod:`._standby`) runs the script itself up to its first
``Run()``, so what the script does before ``Run()`` -- prints, downloads, log files, any side
effect, the memory it holds -- happens once more per standby, beside the live trainer. This one
waits *before* the script, so nothing of the script runs anywhere but in the process that
trains: the same command, rewritten from ``python [OPTIONS] SCRIPT ARGS`` (or ``python -m MODULE
ARGS``) into ``python [OPTIONS] -c BOOT -- SCRIPT ARGS``, where ``BOOT`` puts on ``sys.path``
what Python would have put there for the script, imports torch, ``torch._dynamo`` (the first
``torch.optim`` optimizer imports it: ~1.5 s of a typical script's set-up) and unbroken, waits
on the standby's pipe (:func:`unbroken.train._as_standby.wait_for_turn`, the same wait and the same
signals as the deep standby), then runs the script with :mod:`runpy` as ``__main__``. Its
environment is the next attempt's from the start, as for the deep standby; only the imports are
saved, not the script's own set-up.

What a script sets in ``os.environ`` for torch *before* its ``import torch`` came too late for
the torch this interpreter imported: :class:`TorchEnvironment` compares the variables torch (and
its OpenMP and MKL runtimes) read when they load with what they were at that import, when the
script imports torch (or, failing that, at its first ``Run()``). A thread count
(``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``) is applied as torch would have applied it
(``torch.set_num_threads``: the same count, so the same arithmetic as a fresh process); any
other is said on stderr, with what to do instead.

A command this cannot rewrite (a shell script, ``python -c``, a wrapper, an interpreter option
it does not know) gets no standby: :func:`command` returns None and the supervisor says why.

``torchrun --standalone`` gets a standby torchrun (:func:`torchrun_command`): the same launcher
options, with each worker started as ``PY -u -c BOOT -- SCRIPT ARGS`` through ``--no-python``,
where torchrun would have run ``PY -u SCRIPT ARGS``. With ``--standalone`` its rendezvous and
store are its own (a free port on localhost), so its agent and workers start beside the live
job without meeting it; each worker waits before the script, so no rank reaches
``init_process_group`` or the GPU before it is promoted. torchrun closes every other fd of its
workers, so their signal to go is a FIFO, not the inherited pipe (:mod:`._standby`).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from typing import Any

PRELOAD = ("torch", "torch._dynamo", "unbroken")
"""What the waiting interpreter imports; each is tried, one that fails is left to the script."""

THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Read by torch when it loads, in this order (the second wins): applied after the fact."""
READ_AT_LOAD = ("OMP_", "KMP_", "GOMP_", "MKL_", "TORCHDYNAMO_", "TORCHINDUCTOR_")
"""Prefixes of variables that torch, its OpenMP and MKL runtimes or the modules preloaded read
when they load (``torch._dynamo`` imports ``torch._inductor.config``)."""
READ_AT_LOAD_NAMES = frozenset(
    {"TORCH_LOGS", "TORCH_LOGS_FORMAT", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES"}
)

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_BARE_FLAGS = frozenset("bBdEIOPqsSuvR")  # options of CPython 3.11 that take no value
_VALUE_FLAGS = frozenset("WX")  # -W ARG, -X ARG (or -Wdefault, -Xdev)

# Run by the waiting interpreter as ``-c``. sys.argv is then ['-c', '-m' or '--', TARGET, ...]
# and sys.path[0] is '' (unless -P/-I): set it as Python would for TARGET *before* importing
# unbroken, so that the unbroken found is the one the script would find. It begins with "-0;"
# (a statement that does nothing) because torchrun names a failed job after the first of its
# workers' arguments that does not begin with "-": so its report names TARGET, as without us.
BOOT = (
    "-0;import os,sys;m,t=sys.argv[1:3];"
    "sys.path[:1]=[os.getcwd() if m=='-m' else os.path.dirname(os.path.realpath(t))]"
    " if sys.path[:1]==[''] else sys.path[:1];"
    "from unbroken.supervise._warm import main;main()"
)


def command(cmd: list[str]) -> list[str] | None:
    """``cmd`` rewritten for a waiting interpreter, or None when it is not a plain ``python
    [OPTIONS] SCRIPT ARGS`` / ``python [OPTIONS] -m MODULE ARGS``."""
    if not cmd or not _PYTHON.match(os.path.basename(cmd[0])):
        return None
    i, flags = 1, list[str]()
    while i < len(cmd):
        word = cmd[i]
        if word == "-m":
            if i + 1 >= len(cmd):
                return None
            return [cmd[0], *flags, "-c", BOOT, "-m", *cmd[i + 1 :]]
        if word in ("-", "-c", "--") or not word.startswith("-"):
            break
        letters = word[1:]
        if letters[:1] in _VALUE_FLAGS:
            value = letters[1:] or (cmd[i + 1] if i + 1 < len(cmd) else None)
            if value is None:
                return None
            flags += [word] if letters[1:] else [word, value]  # kept as written
            i += 1 if letters[1:] else 2
            continue
        if not letters or not set(letters) <= _BARE_FLAGS:
            return None  # unknown, or one that does not just run the script (-h, -V, -i)
        flags.append(word)
        i += 1
    if i >= len(cmd) or cmd[i] in ("-", "-c", "--"):
        return None  # `python` alone, stdin, `-c CODE`: nothing to run from a file
    return [cmd[0], *flags, "-c", BOOT, "--", *cmd[i:]]


TORCHRUN_FLAGS = frozenset(
    {"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}
    | {"--virtual-local-rank", "--virtual_local_rank"}
)
"""torchrun's options that take no value (torch 2.13; every other one takes one value, and
``tests/process/test_standby_torchrun.py`` checks both sets against torchrun's own parser)."""
_VALUED_NAMES = (
    "nproc-per-node rdzv-backend rdzv-endpoint rdzv-id rdzv-conf max-restarts monitor-interval "
    "start-method event-log-handler log-dir local-ranks-filter duplicate-stdout-filters "
    "duplicate-stderr-filters node-rank master-addr master-port local-addr logs-specs "
    "numa-binding signals-to-handle shutdown-timeout"
).split()
TORCHRUN_VALUED = frozenset(
    [f"--{n}" for n in _VALUED_NAMES]
    + [f"--{n.replace('-', '_')}" for n in _VALUED_NAMES]  # torchrun accepts both spellings
    + ["--nnodes", "--role", "-r", "--redirects", "-t", "--tee"]
)
_TORCHRUN_MODULES = ("torch.distributed.run",)


def torchrun_command(cmd: list[str], env: Mapping[str, str]) -> list[str] | None:
    """``cmd``, a ``torchrun --standalone [OPTIONS] SCRIPT ARGS`` (or ``python -m
    torch.distributed.run ...``, or ``-m MODULE``), rewritten so that its workers wait before
    the script; None for any other command, or options this does not know."""
    if not cmd:
        return None
    if os.path.basename(cmd[0]) == "torchrun":
        start, python = 1, _shebang(cmd[0])
    elif (
        _PYTHON.match(os.path.basename(cmd[0]))
        and cmd[1:2] == ["-m"]
        and cmd[2:3] == [_TORCHRUN_MODULES[0]]
    ):
        start, python = 3, shutil.which(cmd[0]) or cmd[0]
    else:
        return None
    python = env.get("PYTHON_EXEC") or python  # what torchrun runs its workers with
    if python is None or any(env.get(f"PET_{v}", "0") != "0" for v in _PET_REFUSED):
        return None
    i, opts, seen = start, list[str](), set[str]()
    while i < len(cmd) and cmd[i].startswith("-") and cmd[i] != "--":
        name, eq, _ = cmd[i].partition("=")
        short = name[:2] in ("-r", "-t") and len(name) > 2 and not name.startswith("--")
        if name in TORCHRUN_FLAGS and not eq:
            seen.add(name.replace("_", "-"))
            if name not in ("-m", "--module"):
                opts.append(cmd[i])
            i += 1
        elif (name in TORCHRUN_VALUED and eq) or short:
            opts.append(cmd[i])
            i += 1
        elif name in TORCHRUN_VALUED and i + 1 < len(cmd):
            opts += cmd[i : i + 2]
            i += 2
        else:
            return None  # unknown, abbreviated, -h, or a value missing
    i += cmd[i : i + 1] == ["--"]
    standalone = "--standalone" in seen or env.get("PET_STANDALONE", "0") != "0"
    if i >= len(cmd) or not standalone or {"--no-python", "--run-path"} & seen:
        return None  # a shared rendezvous, or workers that are not `python SCRIPT`
    module = bool({"-m", "--module"} & seen) or env.get("PET_MODULE", "0") != "0"
    how = "-m" if module else "--"
    return [*cmd[:start], *opts, "--no-python", python, "-u", "-c", BOOT, how, *cmd[i:]]


_PET_REFUSED = ("NO_PYTHON", "RUN_PATH")  # torchrun reads its flags from PET_* too


def _shebang(path: str) -> str | None:
    """The interpreter of the ``torchrun`` script on PATH (the ``python`` it runs workers with)."""
    found = shutil.which(path)
    try:
        with open(found or path, "rb") as f:
            line = f.readline(4096)
    except OSError:
        return None
    words = line[2:].decode(errors="replace").split() if line.startswith(b"#!") else []
    if len(words) == 1 and _PYTHON.match(os.path.basename(words[0])):
        return words[0]
    return None


def _read_at_load(name: str) -> bool:
    return name in READ_AT_LOAD_NAMES or name.startswith(READ_AT_LOAD)


def _thread_count(env: Mapping[str, str]) -> int:
    """The thread count torch takes from ``env`` when it loads (0: none given)."""
    count = 0
    for name in THREADS:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            count = int(value)
    return count


class TorchEnvironment:
    """The variables torch read when this interpreter imported it, before the script ran (as
    they are after that import); :meth:`check` catches up with what the script set before its
    own ``import torch``."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.seen = {k: v for k, v in env.items() if _read_at_load(k)}
        self.checked = False

    def check(self) -> None:
        """Apply (a thread count) or say (anything else) what changed since; once."""
        if self.checked:
            return
        self.checked = True
        now = {k: v for k, v in os.environ.items() if _read_at_load(k)}
        changed = sorted(k for k in self.seen.keys() | now.keys() if self.seen.get(k) != now.get(k))
        late = [k for k in changed if k not in THREADS]
        if any(k in THREADS for k in changed):
            count = _thread_count(now)
            if count:
                import torch

                torch.set_num_threads(count)
            else:
                late += [k for k in changed if k in THREADS]
        if late:
            what = ", ".join(f"{k}={now[k]}" if k in now else f"{k} (unset)" for k in late)
            sys.stderr.write(
                f"unbroken: the script set {what} before importing torch, but it runs in the warm "
                "standby, which imported torch before the script (unbroken run's default): torch "
                "read the environment then, so this has no effect here. Set it in the environment "
                "of `unbroken run` instead, or run with --no-standby.\n"
            )
            sys.stderr.flush()


def _watch_torch_import(env: TorchEnvironment) -> None:
    """Call ``env.check`` when the script first imports torch -- the moment a fresh process's
    torch would have read the environment -- or else at its first ``Run()``. An ``import`` of a
    module already loaded looks nothing up, so the look-out is ``builtins.__import__``, which
    every ``import`` statement calls (until then only)."""
    import builtins

    from ..train import _as_standby

    original = builtins.__import__

    def restore() -> None:
        if builtins.__import__ is hook:
            builtins.__import__ = original

    def hook(name: str, *args: Any, **kwargs: Any) -> Any:
        level = args[3] if len(args) > 3 else kwargs.get("level", 0)
        if level == 0 and (name == "torch" or name.startswith("torch.")):
            restore()
            env.check()
        return original(name, *args, **kwargs)

    def first_run() -> None:
        restore()
        env.check()

    builtins.__import__ = hook
    _as_standby.at_first_run = first_run


def main() -> None:
    """In the waiting interpreter (see :data:`BOOT`): import, wait for the promotion, run."""
    import importlib
    import logging
    import runpy

    log = logging.getLogger("unbroken.run")
    how, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # the script imports what it needs; it will say what fails
            log.debug("unbroken: the standby could not preload %s: %s", name, e)
    # What torch read, and what its import set itself (TORCHINDUCTOR_CACHE_DIR): the baseline
    # for what the script sets.
    env = TorchEnvironment(os.environ)
    from ..train._as_standby import wait_for_turn

    wait_for_turn()  # returns once promoted; exits 75 when told to go away
    _watch_torch_import(env)
    if how == "-m":
        sys.argv = [target, *args]  # run_module puts the module's file in argv[0]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # run_path puts its argument in argv[0]: absolute, as Python's own __main__.__file__
        sys.argv = [target, *args]
        runpy.run_path(os.path.abspath(target), run_name="__main__")
