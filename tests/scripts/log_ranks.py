"""A tiny DDP run (gloo, CPU) for tests/process/test_logging.py: what each rank logs.

``--steps N``: train to step N, saving every 2; ``--stop-at K``: rank 0 sends itself SIGTERM in
step K (both ranks stop together, exit 75); ``--configure``: ``logging.basicConfig`` at INFO with
the rank in each line (else logging is left unconfigured: only lastResort's WARNING+ shows).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

import torch
import torch.distributed as dist

import unbroken


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--configure", action="store_true")
    a = p.parse_args()
    if a.configure:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("LOG %(levelname)s r%(rank)s %(message)s"))
        logging.getLogger("unbroken").addHandler(handler)
        logging.getLogger("unbroken").setLevel(logging.INFO)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = unbroken.Run(
        a.run_dir, model=model, optimizer=opt, save_every=2, max_steps=a.steps, progress=False
    )
    while not run.done:
        loss = model(torch.ones(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if a.stop_at == run.counters.step + 1 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        run.step(loss=loss)
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
