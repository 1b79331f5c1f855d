"""The PyTorch DDP tutorial's pattern (``MASTER_PORT=12355``): a fixed port bound at the top
of the script, before ``Run()`` -- set-up that cannot run twice beside the trainer.

    python tests/scripts/fixed_port.py --run-dir RUN --port PORT [--steps N] [--step-sleep S]
"""

from __future__ import annotations

import argparse
import socket
import time

import torch

import unbroken

p = argparse.ArgumentParser()
p.add_argument("--run-dir", required=True)
p.add_argument("--port", type=int, required=True)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--step-sleep", type=float, default=0.1)
a = p.parse_args()

sock = socket.socket()
sock.bind(("127.0.0.1", a.port))  # the line a second copy of the set-up fails at
sock.listen()
print("=== fixed_port set-up", flush=True)

torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
run = unbroken.Run(
    a.run_dir, model=model, optimizer=opt, max_steps=a.steps, save_every=100, progress=False
)
while not run.done:
    model(torch.ones(2, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(a.step_sleep)
    run.step(loss=1.0)
run.finish()
