"""A plain ``Run`` with DataLoader workers, for the tree-signal harness (tests/treesig.py).

    python tests/scripts/tree_train.py --run-dir D [--loader map|shards] [--workers 2]
        [--persistent] [--steps 30] [--save-every 5] [--step-sleep 0.02]

``map``: ``unbroken.MapLoader`` over 24 samples, batch 8: an epoch is 3 steps, so workers
that are not persistent start again every 3 steps. ``shards``: ``unbroken.data.IterableShards`` over
6 shards of 5 samples read by 2 workers. MLP with dropout, AdamW, EMA, a noisy dataset (the
noise drawn from the per-sample generator). Prints ``start N`` once the Run is open and
``done`` after the final save; exits 0 when complete, 75 when stopped.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

import unbroken


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def get_sample(self, i: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(8, generator=generator), self.y[i]


class Shard:
    """Shard k of the stream: samples k*size .. (k+1)*size - 1, from any start (picklable)."""

    def __init__(self, data: Noisy, k: int, size: int) -> None:
        self.data, self.k, self.size = data, k, size

    def __call__(self, start: int) -> Iterator[dict[str, Any]]:
        for i in range(self.k * self.size + start, (self.k + 1) * self.size):
            yield {"x": self.data.x[i], "y": self.data.y[i]}


def _noise(sample: dict[str, Any], generator: torch.Generator) -> tuple[torch.Tensor, Any]:
    return sample["x"] + 0.1 * torch.randn(8, generator=generator), sample["y"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--loader", choices=["map", "shards"], default="map")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.02)
    a = p.parse_args()

    torch.set_num_threads(1)
    unbroken.seed_everything(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ema = unbroken.EMA(model, decay=0.9)
    loader: Any
    if a.loader == "map":
        loader = unbroken.MapLoader(
            Noisy(24),
            batch_size=8,
            shuffle=True,
            seed=7,
            num_workers=a.workers,
            persistent_workers=a.persistent,
        )
    else:
        data = Noisy(30)
        loader = unbroken.data.IterableShards(
            [Shard(data, k, 5) for k in range(6)],
            batch_size=8,
            seed=7,
            num_workers=a.workers,
            augment=_noise,
        )
    run = unbroken.Run(
        a.run_dir,
        model=model,
        optimizer=opt,
        ema=ema,
        loader=loader,
        save_every=a.save_every,
        max_steps=a.steps,
        progress=False,
    )
    print(f"start {run.counters.step}", flush=True)
    for x, y in run.loop(loader):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema.update()
        time.sleep(a.step_sleep)
        run.step(loss=loss)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
