"""A training script whose set-up before ``Run()`` has side effects, as real ones do.

Before ``Run()`` it prints a banner, opens ``RUN/train.log`` for writing (``logging.basicConfig``
with ``filemode="w"``) and logs every step there, "downloads" its data unconditionally (writes
``RUN/data.bin`` in chunks, then reads every sample through ``np.memmap``: a truncation of that
file under the trainer kills it with SIGBUS), writes ``RUN/config.json`` and appends one line to
``RUN/setup.txt`` (pid, attempt, torch's thread count). Under ``unbroken run`` all of it must
happen once per attempt, in the process that trains, and nowhere else.

``--omp N`` sets ``OMP_NUM_THREADS`` at the top of the script, before ``import torch``, as
scripts do; ``--bug-at K`` raises a NameError after every step from K on (a bug); ``--fake-cuda``
makes ``torch.cuda.is_initialized()`` say True before ``Run()`` (a script that moved its model to
the GPU, on a machine without one).
"""

from __future__ import annotations

import os
import sys

if "--omp" in sys.argv:  # before torch is imported, as a script sets it
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--omp") + 1]

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import unbroken  # noqa: E402

ROWS, FEATURES, CHUNKS = 2048, 8, 16


def data_bytes() -> bytes:
    """What the "download" fetches: the same bytes every time."""
    rng = np.random.default_rng(1234)
    return rng.standard_normal((ROWS, FEATURES), dtype=np.float32).tobytes()


def download(dest: str, pace: float) -> None:
    """Unconditional, in chunks, at a network's pace: as a naive downloader does."""
    blob = data_bytes()
    size = len(blob) // CHUNKS
    with open(dest, "wb") as f:
        for i in range(CHUNKS):
            f.write(blob[i * size : (i + 1) * size])
            f.flush()
            time.sleep(pace)


class Mapped(torch.utils.data.Dataset):
    """Every sample read from the memory-mapped file, at every step."""

    def __init__(self, path: str) -> None:
        self.x = np.memmap(path, dtype=np.float32, mode="r", shape=(ROWS, FEATURES))
        self.w = torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int):
        x = torch.from_numpy(np.array(self.x[i]))
        return x, x @ self.w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pace", type=float, default=0.01, help="seconds per downloaded chunk")
    p.add_argument("--omp", default=None)
    p.add_argument("--bug-at", type=int, default=None)
    p.add_argument("--fake-cuda", action="store_true")
    a = p.parse_args()

    print(f"=== setup_effects: training in {a.run_dir} ===", flush=True)
    os.makedirs(a.run_dir, exist_ok=True)
    logging.basicConfig(
        filename=os.path.join(a.run_dir, "train.log"),
        filemode="w",
        level=logging.INFO,
        format="%(name)s %(message)s",
    )
    log = logging.getLogger("train")
    data = os.path.join(a.run_dir, "data.bin")
    download(data, a.pace)
    with open(os.path.join(a.run_dir, "config.json"), "w") as f:
        json.dump({"steps": a.steps, "rows": ROWS, "features": FEATURES}, f, indent=2)
    with open(os.path.join(a.run_dir, "setup.txt"), "a") as f:
        attempt = os.environ.get("UNBROKEN_ATTEMPT", "-")
        f.write(f"{os.getpid()} {attempt} {torch.get_num_threads()}\n")
    if a.fake_cuda:
        torch.cuda.is_initialized = lambda: True  # type: ignore[assignment]

    unbroken.seed_everything(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 1),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = unbroken.MapLoader(Mapped(data), batch_size=16, shuffle=True, seed=7)
    run = unbroken.Run(
        a.run_dir,
        model=model,
        optimizer=opt,
        loader=loader,
        save_every=a.save_every,
        max_steps=a.steps,
        progress=False,
    )
    for x, y in run.loop(loader):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.step(loss=loss.item())
        log.info("step %d loss %.8f", run.counters.step, loss.item())
        if a.bug_at is not None and run.counters.step >= a.bug_at:
            print(undefined_name)  # noqa: F821  (the bug)
        if a.step_sleep:
            time.sleep(a.step_sleep)


if __name__ == "__main__":
    main()
