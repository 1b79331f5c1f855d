"""``unbroken pin RUN STEP`` / ``unbroken unpin RUN STEP``: keep a checkpoint through retention."""

from __future__ import annotations

import argparse
from typing import Any

from ..process._exit import EXIT_OK


def register(subparsers: Any) -> None:
    for name, pinned, text in (
        ("pin", True, "keep a checkpoint whatever the retention policy says"),
        ("unpin", False, "let retention delete a pinned checkpoint again"),
    ):
        p = subparsers.add_parser(name, help=text, description=text.capitalize() + ".")
        p.add_argument("run_dir", metavar="RUN", help="the run directory")
        p.add_argument("step", type=int, metavar="STEP", help="the checkpoint's step")
        p.set_defaults(func=run, pinned=pinned)


def run(args: argparse.Namespace) -> int:
    from ..store import CheckpointStore

    CheckpointStore(args.run_dir).pin(args.step, args.pinned)
    state = "pinned" if args.pinned else "unpinned"
    print(f"step {args.step} of {args.run_dir}: {state}")
    return EXIT_OK
