"""The shallow warm standby (``unbroken run --standby imports``): a Python interpreter that has
imported torch and unbroken, waiting to run the script.

The default standby (:mod:`._standby`) runs the script itself up to its first ``Run()``, so what
the script does before ``Run()`` -- prints, downloads, any side effect -- happens once more per
standby. Where that is not acceptable, this one waits *before* the script: the same command,
rewritten from ``python [OPTIONS] SCRIPT ARGS`` (or ``python -m MODULE ARGS``) into ``python
[OPTIONS] -c BOOT -- SCRIPT ARGS``, where ``BOOT`` puts on ``sys.path`` what Python would have put
there for the script, imports torch, ``torch._dynamo`` (the first ``torch.optim`` optimizer
imports it: ~1.5 s of a typical script's set-up) and unbroken, waits on the standby's pipe
(:func:`unbroken.train._standby.wait_for_turn`, the same wait and the same signals as the
default standby), then runs the script with :mod:`runpy` as ``__main__``. Its environment is
the next attempt's from the start, as for the default standby; only the imports are saved,
not the script's own set-up.

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

PRELOAD = ("torch", "torch._dynamo", "unbroken")
"""What the waiting interpreter imports; each is tried, one that fails is left to the script."""

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
    "from unbroken.cli._warm import main;main()"
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
``tests/test_standby_torchrun.py`` checks both sets against torchrun's own parser)."""
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
    from ..train._standby import wait_for_turn

    wait_for_turn()  # returns once promoted; exits 75 when told to go away
    if how == "-m":
        sys.argv = [target, *args]  # run_module puts the module's file in argv[0]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # run_path puts its argument in argv[0]: absolute, as Python's own __main__.__file__
        sys.argv = [target, *args]
        runpy.run_path(os.path.abspath(target), run_name="__main__")
