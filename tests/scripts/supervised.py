"""Run a training script as ``unbroken run`` would: ``import unbroken`` first (with
``UNBROKEN_SUPERVISED=1`` that installs the stop handlers), then the script, unchanged.

    python tests/scripts/supervised.py SCRIPT [ARGS...]

Prints ``handlers`` once the handlers exist, so that the tree-signal harness can tell a death
by a signal that came before them (the interpreter still starting) from one after.
"""

from __future__ import annotations

import os
import runpy
import sys

import unbroken  # noqa: F401 - installs the handlers under UNBROKEN_SUPERVISED=1

if os.environ.get("UNBROKEN_SUPERVISED") == "1":
    print("handlers", flush=True)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
