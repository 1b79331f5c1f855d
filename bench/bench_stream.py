"""Sharded streams: resume time at sample 10 vs 10^6, and throughput with 2 workers.

    .venv/bin/python bench/bench_stream.py            # ~3 min on 2 idle cores
    .venv/bin/python bench/bench_stream.py --quick

Part 1 writes ``--shards`` JSONL shards holding ``--records`` records in all (indexed once, as
a first use would) and times a fresh ``unbroken.data.JsonlShards`` + ``unbroken.MapLoader``
from ``load_state_dict`` at sample 10 and at sample 10^6 to its first batch, with 0 and 2
workers (target: @1e6 <= 1.1x @1e1 -- no replay). Part 2 reads the same shards with 2 workers:
``unbroken.MapLoader(JsonlShards)`` against a plain ``torch.utils.data.DataLoader`` over an
``IterableDataset`` that gives each worker every other shard and reads it line by line; and
``unbroken.data.IterableShards`` against a plain torch DataLoader over the *same* Hugging Face
``IterableDataset`` (``to_iterable_dataset(num_shards=...)``), when ``datasets`` is installed.
Samples/s, repeats interleaved, medians; the ratio is the median of the ratios within
each repeat (target: unbroken >= 0.95x plain). Neither side
augments, so unbroken's per-sample reseeding is off (``reseed_globals=False``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.utils.data as tud

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import unbroken  # noqa: E402
from unbroken.data import IterableShards, JsonlShards  # noqa: E402

POSITIONS = (10, 10**6)


def write_shards(d: str, shards: int, records: int) -> list[str]:
    per = -(-records // shards)
    for k in range(shards):
        with open(os.path.join(d, f"part-{k:04d}.jsonl"), "w") as f:
            lo = k * per
            f.write("".join(f'{{"id": {i}, "x": {i % 97}}}\n' for i in range(lo, lo + per)))
    return sorted(glob.glob(os.path.join(d, "*.jsonl")))


def resume(files: list[str], workers: int, pos: int, batch: int) -> Callable[[], float]:
    def measure() -> float:
        t = time.perf_counter()
        loader = unbroken.MapLoader(
            JsonlShards(files), batch, seed=0, num_workers=workers, reseed_globals=False
        )
        state = loader.state_dict()
        loader.load_state_dict({**state, "position": pos})
        next(iter(loader))
        took = time.perf_counter() - t
        loader.close()
        return took

    return measure


class PlainShards(tud.IterableDataset):  # type: ignore[type-arg]
    """What one writes by hand: each worker takes every W-th shard and reads its lines."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __iter__(self):
        info = tud.get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        for path in self.files[w::n]:
            with open(path, "rb") as f:
                for line in f:
                    yield json.loads(line)


def rate(loader: object, limit: int) -> float:
    t, seen = time.perf_counter(), 0
    for batch in loader:  # type: ignore[attr-defined]
        seen += len(batch["id"])
        if seen >= limit:
            break
    took = time.perf_counter() - t
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return seen / took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--records", type=int, default=1_200_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--samples", type=int, default=200_000, help="per throughput measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.samples, a.repeats = 60_000, 3
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only
    tmp = tempfile.TemporaryDirectory(prefix="bench-stream-")
    files = write_shards(tmp.name, a.shards, a.records)
    JsonlShards(files)  # first use: builds and caches every shard's index

    # ---- part 1: resume -------------------------------------------------------------------
    keys = [(w, pos) for w in (0, 2) for pos in POSITIONS]
    fns = {k: resume(files, k[0], k[1], a.batch_size) for k in keys}
    for k in keys:
        fns[k]()  # warm-up: imports, first fork, page cache
    times: dict[tuple[int, int], list[float]] = {k: [] for k in keys}
    for r in range(3 * a.repeats):  # each is ~0.1 s: more repeats steady the medians
        s = r % len(keys)
        for k in keys[s:] + keys[:s]:
            times[k].append(fns[k]())
    med = {k: statistics.median(v) for k, v in times.items()}
    load = round(os.getloadavg()[0], 2)
    print(f"resume of {a.shards} shards, {a.records:,} records; load average {load}")
    print("| workers | @1e1 | @1e6 | @1e6 / @1e1 |\n| --- | --- | --- | --- |")
    ratios = {}
    for w in (0, 2):
        ratios[f"w{w}"] = round(med[(w, POSITIONS[1])] / med[(w, POSITIONS[0])], 3)
        print(
            f"| {w} | {med[(w, 10)] * 1e3:.1f} ms | {med[(w, 10**6)] * 1e3:.1f} ms | "
            f"{ratios[f'w{w}']:.2f} |"
        )

    # ---- part 2: throughput with 2 workers ------------------------------------------------
    b = a.batch_size
    modes: dict[str, Callable[[], object]] = {
        "unbroken_jsonl": lambda: unbroken.MapLoader(
            JsonlShards(files), b, seed=0, num_workers=2, reseed_globals=False
        ),
        "plain_jsonl": lambda: tud.DataLoader(PlainShards(files), batch_size=b, num_workers=2),
    }
    try:
        import datasets

        table = datasets.Dataset.from_json(files, cache_dir=os.path.join(tmp.name, "hf"))
        hf = table.to_iterable_dataset(num_shards=a.shards)
        modes["unbroken_hf_iterable"] = lambda: IterableShards(hf, b, seed=0, num_workers=2)
        modes["plain_hf_iterable"] = lambda: tud.DataLoader(hf, batch_size=b, num_workers=2)
    except ImportError:
        pass
    names = list(modes)
    rates_: dict[str, list[float]] = {m: [] for m in names}
    for r in range(a.repeats):
        s = r % len(names)
        for m in names[s:] + names[:s]:
            rates_[m].append(rate(modes[m](), a.samples))
        print(f"repeat {r + 1}: " + ", ".join(f"{m} {rates_[m][-1]:,.0f}/s" for m in names))
    rmed = {m: statistics.median(v) for m, v in rates_.items()}
    print("| reader | samples/s (median) |\n| --- | --- |")
    for m in names:
        print(f"| {m} | {rmed[m]:,.0f} |")
    # The median of each repeat's ratio: the two ran in the same repeat, under similar load.
    through = {
        src: round(
            statistics.median(
                u / p
                for u, p in zip(rates_[f"unbroken_{src}"], rates_[f"plain_{src}"], strict=True)
            ),
            3,
        )
        for src in ("jsonl", "hf_iterable")
        if f"plain_{src}" in rmed
    }
    result = {
        "bench": "stream",
        "shards": a.shards,
        "records": a.records,
        "batch_size": b,
        "repeats": a.repeats,
        "load_average": [load, round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "resume_ms": {f"w{w}_at_{p}": round(med[(w, p)] * 1e3, 2) for w, p in keys},
        "resume_ratio_1e6_over_10": ratios,
        "samples_per_s": {m: round(v) for m, v in rmed.items()},
        "throughput_ratio_unbroken_over_plain": through,
        "throughput_ratio_of_medians": {
            src: round(rmed[f"unbroken_{src}"] / rmed[f"plain_{src}"], 3) for src in through
        },
        "target_resume_ratio": 1.1,
        "target_throughput_ratio": 0.95,
    }
    result["ok"] = all(v <= 1.1 for v in ratios.values()) and all(
        v >= 0.95 for v in through.values()
    )
    print(json.dumps(result))
    tmp.cleanup()


if __name__ == "__main__":
    main()
