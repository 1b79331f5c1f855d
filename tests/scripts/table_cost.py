"""What reading a checkpoint costs in memory, measured in a fresh process.

``table_cost.py WARMUP_RUN RUN OP``: run OP (``resume``, ``inspect`` or ``ls``) on WARMUP_RUN
first -- a small run of the same model, so that the baseline includes everything a read needs
(torch's lazy imports and pools) -- then on RUN; print one JSON line with the peak resident
memory's growth during the second and how OP ended.

``resume`` is what a relaunch does: the newest checkpoint that verifies (checksums, the table,
the state files), restored into the module -- one buffer per tensor the state names, built
before the measurement from state.json (a trainer has its model before it resumes).
``read`` is what ``inspect`` reads before it prints: the newest checkpoint that verifies, and
every check a load runs (``check_contents``). ``inspect`` (``inspect-json``: with ``--json``)
and ``ls`` are the commands, their output counted and dropped.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import io
import json
import os
import sys

import torch

from tests._memory import peak, reset_peak
from unbroken import CheckpointError, StateError
from unbroken.cli import main
from unbroken.state import Registry
from unbroken.store import CheckpointStore


def model(run: str) -> Registry:
    """The module a checkpoint of tests/_crafted.py restores into, built from its files."""
    (ckpt,) = glob.glob(os.path.join(run, "checkpoints", "step-*"))
    with open(os.path.join(ckpt, "state.json")) as f:
        names = list(json.load(f)["components"]["model"])
    with open(os.path.join(ckpt, "tensors.json")) as f:
        table = json.load(f)["tensors"]
    box = torch.nn.Module()
    for key in names:
        spec = table[f"model/{key}"]
        dtype = getattr(torch, spec["dtype"])
        box.register_buffer(key, torch.zeros(spec["shape"], dtype=dtype))
    reg = Registry()
    reg.add("model", box)
    return reg


def resume(run: str, reg: Registry) -> str:
    reader = CheckpointStore(run).latest()
    assert reader is not None
    reader.check_contents()
    trees = reader.global_trees()
    infos = reader.tensor_infos()
    names = reg.check_names(trees)
    targets = reg.plan(names, trees, infos)
    reader.load_tensors(targets)
    reg.restore(names, trees, targets)
    return f"restored step {reader.step}"


def read(run: str) -> str:
    reader = CheckpointStore(run).latest()
    assert reader is not None
    reader.check_contents()
    return f"read step {reader.step}, {len(reader.tensor_infos())} tensors"


class _Count(io.TextIOBase):
    """A stdout that counts what is written and keeps none of it: the output's own size is
    not the command's cost (a terminal or a pipe does not keep it either)."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, s: str) -> int:
        self.n += len(s)
        return len(s)


def cli(op: str, run: str) -> str:
    argv = ["inspect", run, "--json"] if op == "inspect-json" else [op, run]
    with contextlib.redirect_stdout(_Count()) as out:
        code = main(argv)
    return f"exit {code}, {out.n} characters"


def do(op: str, run: str, reg: Registry | None) -> str:
    try:
        if op == "read":
            return read(run)
        return resume(run, reg) if reg is not None else cli(op, run)
    except (CheckpointError, StateError) as e:
        return f"refused: {type(e).__name__}: {str(e)[:300]}"


if __name__ == "__main__":
    warmup, run, op = sys.argv[1:4]
    first = do(op, warmup, model(warmup) if op == "resume" else None)
    reg = model(run) if op == "resume" else None
    gc.collect()
    base = reset_peak()
    outcome = do(op, run, reg)
    print(json.dumps({"warmup": first, "outcome": outcome, "grown": peak() - base}))
