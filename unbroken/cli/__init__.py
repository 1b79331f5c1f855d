"""The ``unbroken`` command. Each subcommand lives in its own module with ``register``/``run``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._errors import CheckpointNotFoundError, UnbrokenError
from .._exit import EXIT_FAILURE, EXIT_NO_CHECKPOINT
from .._version import __version__
from . import _commands

EPILOG = """exit codes: 0 success, 1 failure, 2 usage error, 3 no valid checkpoint,
75 resumable (stopped after saving; relaunch to continue)"""


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CheckpointNotFoundError as e:
        print(f"unbroken: {e}", file=sys.stderr)
        return EXIT_NO_CHECKPOINT
    except UnbrokenError as e:
        print(f"unbroken: {e}", file=sys.stderr)
        return EXIT_FAILURE


__all__ = ["build_parser", "main"]
