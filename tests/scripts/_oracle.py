"""What a test script leaves for the bitwise oracle, written by the script itself.

The golden tests compare two runs' final states; read through unbroken's own
``CheckpointReader`` only, a bug that read both runs wrongly alike would pass. So a script also
writes, with the safetensors library and plain text, what it holds when it ends:

- ``RUN/oracle/final.safetensors``: every tensor of its components' ``state_dict()``, by path
  (``model/0.weight``, ``optimizer/state/0/exp_avg``, ...);
- ``RUN/oracle/final.json``: their other values (step counts, hyper-parameters, ...);
- ``RUN/oracle/losses.txt``: a line per step, ``STEP LOSS`` with the loss as the exact hex of a
  float. A relaunch truncates it to the step it resumed from: the lines after it were written
  by a process that died before its next checkpoint, and are redone.

``tests/golden.py`` reads them back without unbroken (``assert_identical``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file

DIR = "oracle"


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor], values: dict[str, Any]):
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{path}/{k}", tensors, values)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{path}/{i}", tensors, values)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        values[path] = obj
    else:
        values[path] = repr(obj)


class Oracle:
    """``first_step``: the step the run starts at (``run.counters.step`` after ``Run()``);
    ``write``: whether this process writes (rank 0 of a job); ``full``: a tensor as one whole
    tensor (a DTensor's ``full_tensor()``: a collective, so every rank calls :meth:`finish`)."""

    def __init__(
        self,
        run_dir: str,
        first_step: int,
        write: bool = True,
        full: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> None:
        self.dir = os.path.join(run_dir, DIR)
        self.write, self.full = write, full
        self.file = None
        if not write:
            return
        os.makedirs(self.dir, exist_ok=True)
        path = os.path.join(self.dir, "losses.txt")
        kept = []
        if os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if int(line.split()[0]) <= first_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        self.file = open(path, "a", buffering=1)  # a line per step reaches the OS at once

    def step(self, step: int, loss: float | torch.Tensor) -> None:
        if self.file is not None:
            self.file.write(f"{step} {float(loss).hex()}\n")

    def finish(self, **components: Any) -> None:
        tensors: dict[str, torch.Tensor] = {}
        values: dict[str, Any] = {}
        for name, comp in components.items():
            _flatten(comp.state_dict(), name, tensors, values)
        tensors = {k: self.full(v).detach().cpu().contiguous() for k, v in tensors.items()}
        if not self.write:
            return
        save_file(tensors, os.path.join(self.dir, "final.safetensors"))
        with open(os.path.join(self.dir, "final.json"), "w") as f:
            json.dump(values, f, sort_keys=True)
        if self.file is not None:
            self.file.close()
