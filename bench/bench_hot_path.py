"""The hot path from outside: a fast training loop with and without unbroken, side by side.

    .venv/bin/python bench/bench_hot_path.py [--quick] [--rounds N] [--workers 0 2]

A small MLP (batch 64, steps of a few ms with one thread) over a dataset whose ``__getitem__``
adds noise from a *global* random stream (``--noise torch|numpy|python|none``), trained by

  plain      a hand-written loop over ``torch.utils.data.DataLoader(shuffle=True)``
  unbroken   ``unbroken.Run`` + ``unbroken.MapLoader`` with default settings
             (``run.loop``, ``run.step(loss=loss)``; metrics log and signal handlers on)

for each worker count in ``--workers``. With ``--char-lm``, the same comparison on
examples/char_lm.py's model, data and step (AdamW, bf16 autocast + GradScaler, EMA; 2 workers;
its dataset's ``get_sample`` fed a per-sample generator in the plain loop too).

All variants live in one process and take turns in blocks of ``--block`` steps for
``--rounds`` rounds (rotating order, the first step after a switch not counted), so the
machine's drift hits them alike. Reported: the median step of
each, the overhead (median of the per-round ratios of the block medians, and its spread) and
the overhead per sample in microseconds. Targets: <= 10% with 0 workers, <= 1% with 2.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as tud

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import unbroken  # noqa: E402

TARGETS = {0: 0.10, 2: 0.01}
ROOT = Path(__file__).resolve().parent.parent


class Noisy(tud.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed inputs plus noise drawn from a global random stream in ``__getitem__``."""

    def __init__(self, n: int, dim: int, classes: int, noise: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(classes, (n,), generator=g)
        self.noise = noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.noise == "torch":
            x = x + 0.1 * torch.randn(x.shape)
        elif self.noise == "numpy":
            x = x * float(np.random.uniform(0.9, 1.1))
        elif self.noise == "python":
            x = x * random.uniform(0.9, 1.1)
        return x, self.y[i]


def mlp(dims: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def plain(dims: list[int], data: tud.Dataset[Any], batch: int, workers: int) -> Iterator[None]:
    torch.manual_seed(0)
    model = mlp(dims)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = tud.DataLoader(
        data,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )
    while True:
        for x, y in loader:
            step(model, opt, x, y)
            yield


def with_unbroken(
    dims: list[int], data: tud.Dataset[Any], batch: int, workers: int, run_dir: str
) -> Iterator[None]:
    torch.manual_seed(0)
    model = mlp(dims)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = unbroken.MapLoader(
        data, batch, seed=0, num_workers=workers, persistent_workers=workers > 0
    )
    with unbroken.Run(
        run_dir, model=model, optimizer=opt, loader=loader, save_final=False, progress=False
    ) as run:
        for x, y in run.loop(loader, epochs=10**9):
            run.step(loss=step(model, opt, x, y))
            yield


def char_lm_steps(workers: int, run_dir: str | None) -> Iterator[None]:
    """examples/char_lm.py's training step, with unbroken (``run_dir``) or without."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("char_lm", ROOT / "examples" / "char_lm.py")
    assert spec is not None and spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    torch.manual_seed(0)
    data = ex.Crops(ex.CORPUS.read_text(encoding="utf-8"), 64, stride=32)
    model = ex.CharLM(len(data.chars), 64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu")
    ema = unbroken.EMA(model, decay=0.99)

    def one(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        ema.update()
        return loss

    if run_dir is None:
        plain_data = _PerSample(data)
        loader: Any = tud.DataLoader(
            plain_data,
            batch_size=32,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(0),
        )
        while True:
            for x, y in loader:
                one(x, y)
                yield
    loader = unbroken.MapLoader(
        data, 32, seed=0, num_workers=workers, persistent_workers=workers > 0
    )
    with unbroken.Run(
        run_dir,
        model=model,
        optimizer=opt,
        scaler=scaler,
        ema=ema,
        loader=loader,
        save_final=False,
        progress=False,
    ) as run:
        for x, y in run.loop(loader, epochs=10**9):
            run.step(loss=one(x, y), batch_size=len(loader.last_indices))
            yield


class _PerSample(tud.Dataset[Any]):
    """A ``get_sample(i, generator)`` dataset for a plain torch loader: a generator a sample."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return self.data.get_sample(i, torch.Generator().manual_seed(i))


def fetch_costs(data: tud.Dataset[Any], batch: int, n: int, root: str) -> dict[str, float]:
    """Median seconds of what each variant spends outside the model per step -- fetching a
    batch (0 workers), and ``run.step()`` for unbroken -- alternating batch by batch: far
    steadier on a busy machine than whole steps."""
    plain_it = iter(_forever(tud.DataLoader(data, batch_size=batch, shuffle=True)))
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = unbroken.MapLoader(data, batch, seed=0)
    loss = torch.tensor(1.0)
    got: dict[str, list[float]] = {"plain": [], "unbroken": []}
    with unbroken.Run(
        os.path.join(root, "costs"),
        model=model,
        optimizer=opt,
        loader=loader,
        save_final=False,
        progress=False,
    ) as run:
        ub_it = iter(run.loop(loader, epochs=10**9))
        for i in range(n + 20):
            t0 = time.perf_counter()
            next(plain_it)
            t1 = time.perf_counter()
            next(ub_it)
            run.step(loss=loss)
            t2 = time.perf_counter()
            if i >= 20:
                got["plain"].append(t1 - t0)
                got["unbroken"].append(t2 - t1)
        ub_it.close()
    return {k: statistics.median(v) for k, v in got.items()}


def isolated(n: int = 300) -> dict[str, dict[str, float]]:
    """The loader's seeding alone: ``SampleSeeder.fetch`` of 64 samples against a list
    comprehension of ``dataset[i]``, watched and with all three streams seeded, alternating;
    microseconds added a sample, per kind of noise."""
    from unbroken.data._global_streams import SampleSeeder

    keys = [(0, i) for i in range(64)]
    out = {}
    for noise in ("torch", "numpy", "python", "none"):
        d = Noisy(64 * 10, 128, 10, noise)
        watched = SampleSeeder(0, True)
        watched.fetch(d.__getitem__, keys)  # found by watching: outside the clock
        every = SampleSeeder(0, ("python", "numpy", "torch"))
        fns = {
            "plain": lambda d=d: [d[i] for _, i in keys],
            "watched": lambda d=d, w=watched: w.fetch(d.__getitem__, keys),
            "all_three": lambda d=d, e=every: e.fetch(d.__getitem__, keys),
        }
        got: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(n):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                got[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in got.items()}
        out[noise] = {
            k: round((med[k] - med["plain"]) / len(keys) * 1e6, 2) for k in ("watched", "all_three")
        }
    return out


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def interleave(gens: dict[str, Iterator[None]], rounds: int, block: int) -> dict[str, list]:
    """Per variant, the median step of each round's block."""
    keys = list(gens)
    for g in gens.values():
        for _ in range(block):
            next(g)
    out: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        s = r % len(keys)
        for k in keys[s:] + keys[:s]:
            g = gens[k]
            next(g)
            times = []
            last = time.perf_counter()
            for _ in range(block):
                next(g)
                now = time.perf_counter()
                times.append(now - last)
                last = now
            out[k].append(statistics.median(times))
    for g in gens.values():
        g.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 15, quick 5)")
    p.add_argument("--block", type=int, default=50, help="steps per block")
    p.add_argument("--workers", type=int, nargs="*", default=[0, 2])
    p.add_argument("--noise", default="torch", choices=["torch", "numpy", "python", "none"])
    p.add_argument("--dims", type=int, nargs="+", default=[128, 512, 512, 10])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--char-lm", action="store_true", help="also examples/char_lm.py, 2 workers")
    p.add_argument("--isolated", action="store_true", help="also the loader's seeding alone")
    p.add_argument("--char-lm-block", type=int, default=8, help="char_lm steps per block")
    a = p.parse_args()
    rounds = a.rounds or (5 if a.quick else 15)
    torch.set_num_threads(a.threads)
    batch = 64
    data = Noisy(batch * 4000, a.dims[0], a.dims[-1], a.noise)
    root = tempfile.mkdtemp(prefix="unbroken-bench-hot-")
    result: dict[str, Any] = {"bench": "hot_path", "noise": a.noise, "rounds": rounds}
    load = os.getloadavg()[0]
    try:
        print(
            f"{'workers':>7} {'plain ms':>9} {'unbroken ms':>12} {'overhead':>9} "
            f"{'(IQR)':>17} {'us/sample':>9} {'target':>7}"
        )
        if a.isolated:
            iso = isolated()
            result["isolated_us_per_sample"] = iso
            print("loader seeding alone, us added a sample (watched / all three seeded):")
            for noise, r in iso.items():
                print(f"  {noise:>7}: {r['watched']:6.2f} / {r['all_three']:6.2f}", flush=True)
        if 0 in a.workers:
            costs = fetch_costs(data, batch, 200 if a.quick else 1000, root)
            added = costs["unbroken"] - costs["plain"]
            result["fetch_costs_us"] = {k: round(v * 1e6, 1) for k, v in costs.items()}
            result["added_us_per_sample"] = round(added / batch * 1e6, 2)
            result["added_ms_per_step"] = round(added * 1e3, 4)
            print(
                f"0 workers, outside the model: plain fetch {costs['plain'] * 1e6:.0f} us, "
                f"unbroken fetch + run.step {costs['unbroken'] * 1e6:.0f} us a step: "
                f"{added / batch * 1e6:.2f} us a sample added",
                flush=True,
            )
        for w in a.workers:
            gens = {
                "plain": plain(a.dims, data, batch, w),
                "unbroken": with_unbroken(a.dims, data, batch, w, os.path.join(root, f"w{w}")),
            }
            t = interleave(gens, rounds, a.block)
            ratios = sorted(u / h - 1 for u, h in zip(t["unbroken"], t["plain"], strict=True))
            q = len(ratios) // 4
            med = {k: statistics.median(v) for k, v in t.items()}
            ov = statistics.median(ratios)
            per_sample = (med["unbroken"] - med["plain"]) / batch * 1e6
            target = TARGETS.get(w)
            print(
                f"{w:>7} {med['plain'] * 1e3:>9.3f} {med['unbroken'] * 1e3:>12.3f} "
                f"{ov:>+9.1%} {f'{ratios[q]:+.1%}..{ratios[-1 - q]:+.1%}':>17} "
                f"{per_sample:>9.2f} {'' if target is None else f'{target:.0%}':>7}",
                flush=True,
            )
            result[f"workers_{w}"] = {
                "plain_ms": round(med["plain"] * 1e3, 4),
                "unbroken_ms": round(med["unbroken"] * 1e3, 4),
                "overhead": round(ov, 4),
                "overhead_iqr": [round(ratios[q], 4), round(ratios[-1 - q], 4)],
                "us_per_sample": round(per_sample, 2),
                "target": target,
                "ok": None if target is None else ov <= target,
            }
        if a.char_lm:
            gens = {
                "plain": char_lm_steps(2, None),
                "unbroken": char_lm_steps(2, os.path.join(root, "char_lm")),
            }
            t = interleave(gens, rounds, a.char_lm_block)
            ratios = sorted(u / h - 1 for u, h in zip(t["unbroken"], t["plain"], strict=True))
            q = len(ratios) // 4
            med = {k: statistics.median(v) for k, v in t.items()}
            ov = statistics.median(ratios)
            print(
                f"char_lm (2 workers): plain {med['plain'] * 1e3:.1f} ms, unbroken "
                f"{med['unbroken'] * 1e3:.1f} ms a step, overhead {ov:+.2%} "
                f"({ratios[q]:+.2%}..{ratios[-1 - q]:+.2%}), target 1%",
                flush=True,
            )
            result["char_lm"] = {
                "plain_ms": round(med["plain"] * 1e3, 3),
                "unbroken_ms": round(med["unbroken"] * 1e3, 3),
                "overhead": round(ov, 4),
                "overhead_iqr": [round(ratios[q], 4), round(ratios[-1 - q], 4)],
                "target": 0.01,
                "ok": ov <= 0.01,
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["load_before"] = round(load, 2)
    result["load_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
