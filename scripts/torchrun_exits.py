"""examples/char_lm.py under torchrun with 2 ranks, to completion, N times in a row.

    .venv/bin/python scripts/torchrun_exits.py [--runs 20] [--steps 40] [--save-every 10]

Every run must exit 0 (torchrun reports a rank's -6 abort as a failure of the whole job).
Prints one line per run and the counts; exit 1 if any run did not exit 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.golden import ROOT  # noqa: E402
from tests.torchrun_helpers import finish, start, torchrun  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    a = p.parse_args()
    codes: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="torchrun-exits-") as work:
        for i in range(1, a.runs + 1):
            run_dir = Path(work) / f"run-{i}"
            args = ["--run-dir", str(run_dir), "--steps", str(a.steps)]
            cmd = torchrun(
                *args, "--save-every", str(a.save_every), script=ROOT / "examples" / "char_lm.py"
            )
            t0 = time.monotonic()
            code, out = finish(start(cmd))
            aborted = "terminate called" in out
            final = (run_dir / "final.safetensors").exists()
            codes[f"exit {code}"] += 1
            codes["aborted rank"] += aborted
            print(
                f"run {i}: exit {code}, final.safetensors {'yes' if final else 'no'}, "
                f"{'a rank aborted, ' if aborted else ''}{time.monotonic() - t0:.0f} s",
                flush=True,
            )
            if code != 0:
                print(out[-3000:], flush=True)
    print(f"{a.runs} runs: " + ", ".join(f"{k} {v}" for k, v in sorted(codes.items())))
    return 0 if codes["exit 0"] == a.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
