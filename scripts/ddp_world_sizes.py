"""Same-size resume, bit for bit, at many world sizes and drawn stops (gloo on CPU).

    .venv/bin/python scripts/ddp_world_sizes.py [--worlds 2,3,4,5,6] [--stops 5] [--seed S]
        [--variants ddp,ddp-no_sync,ddp-bf16,fsdp2]

For each world size and variant of tests/scripts/toy_dist.py: one uninterrupted run, then
``--stops`` interrupted runs, each SIGKILLed at a drawn logged step after the first checkpoint,
SIGTERMed at a later drawn step (exit 75), relaunched to the end, and compared with the
uninterrupted run (every tensor with torch.equal, every logged step; tests/golden.py). Prints a
line per run and a table of counts; exit 1 if any run was not bit for bit.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.dist_launch import launch  # noqa: E402
from tests.golden import (  # noqa: E402
    assert_identical,
    draw_stops,  # noqa: E402
    resume_steps,
)
from tests.e2e.test_ddp_world_sizes import SAVE_EVERY, STEPS, TOY, VARIANTS, _args  # noqa: E402


def one(world: int, variant: str, ref: Path, cut: Path, seed: str) -> str:
    kill, term = draw_stops(seed, STEPS, SAVE_EVERY)
    args = ["--run-dir", str(cut), *_args(variant, world)]
    launch(TOY, [*args, "--signal-at", str(kill), "--signal", "KILL"], world)
    launch(TOY, [*args, "--signal-at", str(term), "--signal", "TERM"], world)
    launch(TOY, args, world)
    resumed = resume_steps(cut)
    if resumed != [kill // SAVE_EVERY * SAVE_EVERY, term + 1]:
        return f"kill {kill} term {term}: resumed at {resumed}, not where expected"
    try:
        assert_identical(ref, cut)
    except AssertionError as e:
        return f"kill {kill} term {term}: DIFFERS {str(e)[:160]}"
    return f"kill {kill} term {term}: bitwise"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", default="2,3,4,5,6")
    p.add_argument("--stops", type=int, default=5)
    p.add_argument("--seed", default=str(random.randrange(1 << 30)))
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args()
    print(f"seed {a.seed}")
    counts: dict[tuple[int, str], list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in map(int, a.worlds.split(",")):
            for variant in a.variants.split(","):
                ref = Path(tmp) / f"ref-{world}-{variant}"
                launch(TOY, ["--run-dir", str(ref), *_args(variant, world)], world)
                ok = 0
                for i in range(a.stops):
                    line = one(
                        world,
                        variant,
                        ref,
                        Path(tmp) / f"cut-{world}-{variant}-{i}",
                        f"{a.seed}-{world}-{variant}-{i}",
                    )
                    ok += line.endswith("bitwise")
                    print(f"{world} ranks {variant:12} {line}", flush=True)
                counts[(world, variant)] = [ok, a.stops]
    print("\nranks  variant       bitwise")
    for (world, variant), (ok, n) in counts.items():
        print(f"{world:>5}  {variant:12}  {ok}/{n}")
    return 0 if all(ok == n for ok, n in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
