"""Resume cost of unbroken.MapLoader against the naive way, by position in the epoch.

unbroken: a fresh loader, then ``load_state_dict(state at position p)`` and the first batch.
naive:    a fresh ``torch.utils.data.DataLoader`` whose iterator skips ``p // batch_size``
          batches by fetching them (what resuming a plain loader by "replay" costs).

Both are timed from the fresh loader object to the first batch after the resume point, for
``num_workers`` 0 and 2, over a dataset of 2*10^6 cheap items (``dataset[i] == i``). Variants
run interleaved (each repeat runs every variant once, in rotated order), 7 repeats by
default, and the table shows medians. The last line is one JSON object.

Run: ``.venv/bin/python bench/bench_data_resume.py`` (about a minute on two idle cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils.data as tud

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import unbroken  # noqa: E402

POSITIONS = (10, 10**4, 10**6)


class Cheap:
    """``dataset[i] == i``: the cost measured is the loader's, not the samples'."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def unbroken_resume(n: int, batch_size: int, workers: int, position: int) -> Callable[[], float]:
    def measure() -> float:
        loader = unbroken.MapLoader(Cheap(n), batch_size, seed=0, num_workers=workers)
        state = {**loader.state_dict(), "epoch": 0, "position": position}
        t0 = time.perf_counter()
        loader.load_state_dict(state)
        it = iter(loader)
        batch = next(it)
        dt = time.perf_counter() - t0
        assert loader.last_indices[0] == batch[0].item()
        it.close()
        loader.close()
        return dt

    return measure


def naive_resume(n: int, batch_size: int, workers: int, position: int) -> Callable[[], float]:
    def measure() -> float:
        loader = tud.DataLoader(
            Cheap(n),
            batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=workers,
        )
        t0 = time.perf_counter()
        it = iter(loader)
        for _ in itertools.islice(it, position // batch_size):
            pass
        next(it)
        dt = time.perf_counter() - t0
        del it
        return dt

    return measure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2 * 10**6)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    a = p.parse_args()

    variants: dict[tuple[str, int, int], Callable[[], float]] = {}
    for workers in a.workers:
        for pos in POSITIONS:
            variants[("unbroken", workers, pos)] = unbroken_resume(a.n, a.batch_size, workers, pos)
            variants[("naive", workers, pos)] = naive_resume(a.n, a.batch_size, workers, pos)
    keys = list(variants)
    for key in keys:  # warm-up: imports, first fork, page cache
        if key[2] == POSITIONS[0]:
            variants[key]()
    times: dict[tuple[str, int, int], list[float]] = {k: [] for k in keys}
    for r in range(a.repeats):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].append(variants[key]())
    med = {k: statistics.median(v) for k, v in times.items()}
    load = round(os.getloadavg()[0], 2)  # other work on the machine inflates absolute figures

    print(
        f"resume to the first batch: n={a.n}, batch {a.batch_size}, {a.repeats} repeats, "
        f"medians; load average {load} on {os.cpu_count()} CPUs"
    )
    print()
    header = "| loader | workers | " + " | ".join(
        f"@{p:.0e}".replace("e+0", "e") for p in POSITIONS
    )
    print(header + " | @1e6 / @1e1 |")
    print("|" + " --- |" * (len(POSITIONS) + 3))
    for kind in ("unbroken", "naive"):
        for workers in a.workers:
            cells = [f"{med[(kind, workers, pos)] * 1e3:.1f} ms" for pos in POSITIONS]
            ratio = med[(kind, workers, POSITIONS[-1])] / med[(kind, workers, POSITIONS[0])]
            print(f"| {kind} | {workers} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    print()

    def ratio(kind: str, workers: int) -> float:
        return round(med[(kind, workers, POSITIONS[-1])] / med[(kind, workers, POSITIONS[0])], 3)

    result = {
        "bench": "data_resume",
        "n": a.n,
        "batch_size": a.batch_size,
        "repeats": a.repeats,
        "load_average": load,
        "cpus": os.cpu_count(),
        "median_ms": {
            f"{kind}_w{w}_at_{pos}": round(med[(kind, w, pos)] * 1e3, 2) for kind, w, pos in keys
        },
        "unbroken_ratio_1e6_over_10": {f"w{w}": ratio("unbroken", w) for w in a.workers},
        "naive_ratio_1e6_over_10": {f"w{w}": ratio("naive", w) for w in a.workers},
        "naive_over_unbroken_at_1e6": {
            f"w{w}": round(
                med[("naive", w, POSITIONS[-1])] / med[("unbroken", w, POSITIONS[-1])], 1
            )
            for w in a.workers
        },
        "target_ratio": 1.1,
    }
    result["ok"] = all(v <= 1.1 for v in result["unbroken_ratio_1e6_over_10"].values())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
