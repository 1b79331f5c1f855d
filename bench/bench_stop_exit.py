"""From a SIGTERM to the process's exit: where the time after the stop save goes.

    .venv/bin/python bench/bench_stop_exit.py [--repeats 5]

Two variants, interleaved in every repeat: ``quick`` (the default: after a stop the process
skips the interpreter's final collections and the native destructors,
unbroken/process/_quick_exit.py) and ``off`` (``UNBROKEN_QUICK_EXIT=0``: the interpreter's whole
finalization).

examples/char_lm.py (its defaults, ``--save-every 1000``) is started through a small wrapper
that records, in the trainer, when ``Run._halt`` (the stop, after its save) begins, when the
script's ``__main__`` has unwound (the loader's workers shut down), and when the last ``atexit``
handler runs; the parent records when it sent SIGTERM and when the process was gone (``wait``).
The stop save's own time is its manifest's ``saved_at_unix``. Medians over ``--repeats``; what
follows the last ``atexit`` handler is the interpreter's own finalization (module teardown and
the garbage of the script's objects, torch's included). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WRAPPER = r"""
import atexit, json, runpy, sys, time
T, OUT = {}, sys.argv[1]
def done():
    T["atexit_last"] = time.time()
    json.dump(T, open(OUT, "w"))
atexit.register(done)  # the first registered runs last
import unbroken.train._run as R
halt = R.Run._halt
def timed(self, *a, **k):
    T["halt"] = time.time()
    return halt(self, *a, **k)
R.Run._halt = timed
script = sys.argv[2]
sys.argv = sys.argv[2:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
try:
    runpy.run_path(script, run_name="__main__")
finally:
    T["main_unwound"] = time.time()
"""


def once(tmp: Path, quick: bool) -> dict[str, float]:
    run = tmp / "run"
    shutil.rmtree(run, ignore_errors=True)
    times = tmp / "times.json"
    cmd = [sys.executable, "-c", WRAPPER, str(times), str(ROOT / "examples" / "char_lm.py")]
    cmd += ["--run-dir", str(run), "--steps", "400", "--save-every", "1000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UNBROKEN_QUICK_EXIT": "1" if quick else "0"}
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    log = run / "metrics.jsonl"
    while not log.exists() or len(log.read_text().splitlines()) < 15:
        if p.poll() is not None:
            raise SystemExit(f"char_lm exited {p.returncode} early")
        time.sleep(0.02)
    sent = time.time()
    p.send_signal(signal.SIGTERM)
    p.wait()
    gone = time.time()
    if p.returncode != 75:
        raise SystemExit(f"char_lm exited {p.returncode}, not 75")
    man = sorted(glob.glob(str(run / "checkpoints" / "step-*" / "manifest.json")))[-1]
    saved = json.loads(Path(man).read_text())["saved_at_unix"]
    t = json.loads(times.read_text())
    return {
        "signal_to_saved": saved - sent,
        "saved_to_halt": t["halt"] - saved,
        "halt_to_main_unwound": t["main_unwound"] - t["halt"],
        "main_unwound_to_atexit_done": t["atexit_last"] - t["main_unwound"],
        "atexit_done_to_gone": gone - t["atexit_last"],
        "saved_to_gone": gone - saved,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"quick": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp_s:
        for _ in range(a.repeats):
            for label in runs:
                runs[label].append(once(Path(tmp_s), label == "quick"))
    med = {
        label: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
        for label, rs in runs.items()
    }
    print(f"{'median, seconds':>28} {'quick':>7} {'off':>7}")
    for k in med["quick"]:
        print(f"{k:>28} {med['quick'][k]:7.3f} {med['off'][k]:7.3f}")
    load = os.getloadavg()[0]
    print(
        json.dumps(
            {
                "bench": "stop_exit",
                "when": time.strftime("%Y-%m-%d %H:%M"),
                "load_average": round(load, 2),
                "repeats": a.repeats,
                "median_s": med,
            }
        )
    )


if __name__ == "__main__":
    main()
