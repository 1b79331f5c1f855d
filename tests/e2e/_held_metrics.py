"""tests/scripts/toy_train.py with its metrics log written only when it must be: before a save
or a snapshot, with an event, at close and at exit (never on the clock)."""

import runpy
import sys
from pathlib import Path

from unbroken.train import _metrics

_metrics.FLUSH_SECONDS = _metrics.EARLY = 3600.0
TOY = Path(__file__).resolve().parent.parent / "scripts" / "toy_train.py"
sys.argv[0] = str(TOY)
runpy.run_path(str(TOY), run_name="__main__")
