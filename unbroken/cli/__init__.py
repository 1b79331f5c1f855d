"""The ``unbroken`` command. Each subcommand lives in its own module with ``register``/``run``."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from .._version import __version__
from ..errors import CheckpointNotFoundError, UnbrokenError
from ..process._exit import EXIT_FAILURE, EXIT_NO_CHECKPOINT
from . import _commands

EPILOG = """exit codes: 0 success, 1 failure, 2 usage error, 3 no valid checkpoint,
75 resumable (stopped after saving; relaunch to continue)"""


def build_parser() -> argparse.ArgumentParser:
    """The ``unbroken`` command's argument parser (for documentation tools)."""
    parser = argparse.ArgumentParser(
        prog="unbroken",
        description="Exact, crash-safe resume for PyTorch training.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"unbroken {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _commands.MODULES:
        module.register(sub)
    for p in sub.choices.values():  # the modules' docstrings are reST; --help is plain text
        p.description, p.epilog = plain(p.description), plain(p.epilog)
    return parser


def _pipe_closed() -> int:
    """The reader of stdout went away (``unbroken diff ... | head``): not an error to report.
    stdout is pointed at /dev/null so that flushing it at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_FAILURE


_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str | None) -> str | None:
    """reST markup as plain text: ``:func:`x``` and double-backquoted literals become ``x``."""
    if text is None:
        return None
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


def main(argv: Sequence[str] | None = None) -> int:
    """The ``unbroken`` command: ``main(argv)`` returns its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit: a closed pipe is caught below
        return code
    except BrokenPipeError:
        return _pipe_closed()
    except CheckpointNotFoundError as e:
        print(f"unbroken: {e}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    except UnbrokenError as e:
        print(f"unbroken: {e}", file=sys.stderr)
        return EXIT_FAILURE


__all__ = ["build_parser", "main"]
