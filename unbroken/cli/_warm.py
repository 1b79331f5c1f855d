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
"""

from __future__ import annotations

import os
import re
import sys

PRELOAD = ("torch", "torch._dynamo", "unbroken")
"""What the waiting interpreter imports; each is tried, one that fails is left to the script."""

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_BARE_FLAGS = frozenset("bBdEIOPqsSuvR")  # options of CPython 3.11 that take no value
_VALUE_FLAGS = frozenset("WX")  # -W ARG, -X ARG (or -Wdefault, -Xdev)

# Run by the waiting interpreter as ``-c``. sys.argv is then ['-c', '-m' or '--', TARGET, ...]
# and sys.path[0] is '' (unless -P/-I): set it as Python would for TARGET *before* importing
# unbroken, so that the unbroken found is the one the script would find.
BOOT = (
    "import os,sys;m,t=sys.argv[1:3];"
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
