"""Many trials of the tree-signal harness (tests/treesig.py), one scenario after another.

    .venv/bin/python scripts/tree_signals.py [--trials 100] [--seed 0] [--out FILE]
        [SCENARIO ...]          (default: every scenario; see tests/treesig.py SCENARIOS)

Per scenario: one uninterrupted reference run, then episodes (launches signalled at drawn
moments until one completes, then compared bit for bit with the reference) until ``--trials``
launches were signalled. Prints one line per scenario -- trials, exits 75 and 0, hangs, other
exits, launches with problems, episodes identical / different -- and writes every launch as a
JSON line to ``--out`` (default: tree_signals.jsonl in the temporary directory). Exit 1 if
anything went wrong.
Scenarios run one after another: a trial must not compete with another for the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import treesig  # noqa: E402


def run_scenario(name: str, trials: int, rng: random.Random, out: Path) -> bool:
    sc = treesig.SCENARIOS[name]
    work = Path(tempfile.mkdtemp(prefix=f"treesig-{name}-"))
    try:
        life = treesig.reference(sc, work / "reference")
        counts: Counter[str] = Counter()
        n = 0
        t0 = time.monotonic()
        while counts["trials"] < trials:
            n += 1
            run_dir = work / f"episode-{n}"
            ep = treesig.episode(sc, run_dir, work / "reference", rng, life)
            for o in ep.outcomes:
                counts["launches"] += 1
                if o.signalled:
                    counts["trials"] += 1
                    counts["hang" if o.hung else f"exit {o.code}"] += 1
                    counts["before handlers"] += o.before_handlers
                if o.problems:
                    counts["problems"] += 1
            counts[{True: "identical", False: "different", None: "not compared"}[ep.identical]] += 1
            with out.open("a") as f:
                for o in ep.outcomes:
                    rec = {"scenario": name, "episode": n, **treesig.describe(o)}
                    f.write(json.dumps(rec) + "\n")
                if ep.identical is False:
                    f.write(json.dumps({"scenario": name, "episode": n, "diff": ep.difference}))
                    f.write("\n")
            shutil.rmtree(run_dir, ignore_errors=True)
        minutes = (time.monotonic() - t0) / 60
        other = sorted(
            k for k in counts if k.startswith("exit ") and k not in ("exit 0", "exit 75")
        )
        print(
            f"{name}: {counts['trials']} trials in {counts['launches']} launches "
            f"({minutes:.0f} min): exit 75 {counts['exit 75']}, exit 0 {counts['exit 0']}, "
            f"hangs {counts['hang']}, other exits {sum(counts[k] for k in other)} {other} "
            f"(of which killed before the handlers existed {counts['before handlers']}), "
            f"launches with problems {counts['problems']}; episodes identical "
            f"{counts['identical']}, different {counts['different']}, "
            f"not compared {counts['not compared']}",
            flush=True,
        )
        bad = counts["problems"] or counts["different"] or counts["not compared"]
        return not bad
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("scenarios", nargs="*", default=list(treesig.SCENARIOS))
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "tree_signals.jsonl")
    a = p.parse_args()
    unknown = sorted(set(a.scenarios) - set(treesig.SCENARIOS))
    if unknown:
        p.error(f"unknown scenarios {unknown}; known: {sorted(treesig.SCENARIOS)}")
    rng = random.Random(a.seed)
    ok = True
    for name in a.scenarios:
        ok = run_scenario(name, a.trials, rng, a.out) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
