"""Stop signals sent to a torch DataLoader's 2 workers while they start and while they serve
batches; prints one JSON line: each worker's exit code once signalled (``None``: alive), what torch
raised here meanwhile and, when the workers lived, every batch.

Run in a process of its own (``tests/process/test_workers_protected.py``): what torch does after an
unprotected worker died varies -- it raises "DataLoader worker exited unexpectedly", raises
``EOFError`` from a shared-memory handoff the dead worker was serving, or waits forever on a
lock the worker held when it died -- so this script reports the deaths themselves and leaves
with ``os._exit``, touching the loader no more.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import time

import torch

import unbroken

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.02)
        return torch.tensor([i])


def signal_workers() -> list[multiprocessing.Process]:
    kids = multiprocessing.active_children()
    for p in kids:
        for sig in STOPS:
            try:
                os.kill(p.pid, sig)  # type: ignore[arg-type]
            except ProcessLookupError:
                pass
    return kids


def exit_codes(kids: list[multiprocessing.Process], raised: list[str]) -> list[int | None]:
    # A killed worker is gone within milliseconds; a protected one is still there after 1 s.
    # torch's SIGCHLD handler raises in this process as soon as a worker dies: noted, and the
    # wait goes on.
    deadline = time.monotonic() + 1.0
    while any(p.exitcode is None for p in kids) and time.monotonic() < deadline:
        try:
            for p in kids:
                p.join(max(0.0, deadline - time.monotonic()))
        except RuntimeError as e:
            raised.append(str(e))
    return [p.exitcode for p in kids]


p = argparse.ArgumentParser()
p.add_argument("--protect", action="store_true")
a = p.parse_args()
loader = torch.utils.data.DataLoader(Slow(), num_workers=2)
if a.protect:
    loader = unbroken.protect_workers(loader)
it = iter(loader)
raised: list[str] = []
starting = signal_workers()  # while they start
codes = exit_codes(starting, raised)
got: list[int] = []
if all(c is None for c in codes):
    got.append(int(next(it)[0]))
    time.sleep(0.2)
    codes = exit_codes(signal_workers(), raised)  # while they serve
    if all(c is None for c in codes):
        got += [int(b[0]) for b in it]
out = {"workers": len(starting), "exit_codes": codes, "raised": raised, "got": got}
print(json.dumps(out), flush=True)
os._exit(0)
