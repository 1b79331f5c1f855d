"""Resume cost of TokenBatchLoader over a TextCorpus, by position in the epoch.

A synthetic corpus of 2*10^6 short lines (1-12 words) is written to a temporary directory and
indexed once (the build time is reported separately). Then, for positions of about 10, 10^4
and 10^6 lines into epoch 0, a resume is timed as a relaunched process does it:

    open:   TextCorpus(path)                      (validates the cached index)
    loader: TokenBatchLoader(...), load_state_dict(state at that position), first batch

for the full per-epoch permutation and for chunked shuffling (``chunk_lines``). The states are
mid-window positions (``batch`` 1 of the window holding that line), built from the fields a
real ``state_dict()`` has. Variants run interleaved (each repeat runs every variant once, in
rotated order), 5 repeats by default; the table shows medians. The last line is one JSON object.

Run: ``.venv/bin/python bench/bench_corpus_resume.py`` (about a minute on two idle cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from unbroken.data import TextCorpus, TokenBatchLoader  # noqa: E402

POSITIONS = (10, 10**4, 10**6)
WORDS = np.array("the of and to in a is that for it as with was on be by at this".split())


def write_corpus(path: str, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 13, n)
    words = WORDS[rng.integers(0, len(WORDS), int(lengths.sum()))]
    ends = np.cumsum(lengths)
    with open(path, "w", encoding="utf-8") as f:
        block = 100_000
        for lo in range(0, n, block):
            rows = []
            for i in range(lo, min(n, lo + block)):
                rows.append(" ".join(words[ends[i] - lengths[i] : ends[i]]))
            f.write("\n".join(rows) + "\n")


def state_at(loader: TokenBatchLoader, line: int) -> dict:
    w = loader.window
    return {
        **loader.state_dict(),
        "epoch": 0,
        "start": line // w * w,
        "batch": 1,
        "window_size": w,
        "window_tokens": loader.max_tokens,
        "window": line // w,
    }


def measure(path: str, chunk_lines: int | None, line: int, a: argparse.Namespace) -> tuple:
    t0 = time.perf_counter()
    corpus = TextCorpus(path, tokenize=str.split, chunk_lines=chunk_lines)
    t1 = time.perf_counter()
    loader = TokenBatchLoader(corpus, a.max_tokens, window=a.window, seed=0)
    loader.load_state_dict(state_at(loader, line))
    next(iter(loader))
    t2 = time.perf_counter()
    assert loader.windows_computed == 1 and loader.last_indices
    return t1 - t0, t2 - t1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=2 * 10**6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--window", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--chunk-lines", type=int, default=65536)
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.txt")
        t = time.perf_counter()
        write_corpus(path, a.lines)
        gen_s = time.perf_counter() - t
        size_mb = os.path.getsize(path) / 2**20
        t = time.perf_counter()
        TextCorpus(path)
        build_s = time.perf_counter() - t
        print(f"corpus: {a.lines:,} lines, {size_mb:.0f} MiB (written in {gen_s:.1f} s)")
        print(
            f"index build (first open): {build_s:.2f} s ({a.lines / build_s / 1e6:.1f} M lines/s)"
        )

        modes = {"full": None, "chunked": a.chunk_lines}
        variants = [(m, pos) for m in modes for pos in POSITIONS]
        times: dict[tuple[str, int], list[tuple[float, float]]] = {v: [] for v in variants}
        for r in range(a.repeats):
            k = r % len(variants)
            for mode, pos in variants[k:] + variants[:k]:
                times[(mode, pos)].append(measure(path, modes[mode], pos, a))

    med = {
        v: (statistics.median(o for o, _ in ts), statistics.median(x for _, x in ts))
        for v, ts in times.items()
    }
    print(
        f"\nresume to the first batch, median of {a.repeats} (ms); window {a.window}, "
        f"max_tokens {a.max_tokens}, chunk_lines {a.chunk_lines}"
    )
    print(f"{'shuffle':<9}{'position':>10}{'open':>9}{'loader':>9}{'total':>9}")
    for mode, pos in variants:
        o, x = med[(mode, pos)]
        print(f"{mode:<9}{pos:>10,}{o * 1e3:>9.1f}{x * 1e3:>9.1f}{(o + x) * 1e3:>9.1f}")
    ratio = {m: sum(med[(m, 10**6)]) / sum(med[(m, 10)]) for m in modes}
    print("\nresume@1e6 / resume@10: " + ", ".join(f"{m} {r:.2f}" for m, r in ratio.items()))
    out = {
        "bench": "corpus_resume",
        "lines": a.lines,
        "repeats": a.repeats,
        "index_build_s": round(build_s, 3),
        "median_ms": {
            m: {str(pos): round(sum(med[(m, pos)]) * 1e3, 2) for pos in POSITIONS} for m in modes
        },
        "open_ms": round(statistics.median(med[v][0] for v in variants) * 1e3, 2),
        "ratio_1e6_over_10": round(ratio["full"], 3),
        "ratio_1e6_over_10_chunked": round(ratio["chunked"], 3),
        "ok": all(r <= 1.25 for r in ratio.values()),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
