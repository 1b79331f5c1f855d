"""Exporting results: weights to safetensors, the per-step trace to JSON lines."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..process._logfile import read_metrics
from ..state import EMA
from ..state._adapters import unwrap

TRACE_KEYS = ("step", "epoch", "loss", "lr", "batch_size", "samples")


def export_weights(path: str | os.PathLike[str], **sources: Any) -> dict[str, torch.Tensor]:
    """Write the tensors of modules, EMAs or state dicts to one safetensors file.

    Each tensor is named ``<keyword>.<key>`` (``model.fc.weight``, ``ema.fc.weight``), so
    sources never collide. DDP wrappers are unwrapped; FSDP2's sharded DTensors are gathered,
    so with FSDP2 call it on every rank (it writes on rank 0 only)::

        unbroken.export_weights("run/final.safetensors", model=model, ema=ema)
    """
    from safetensors.torch import save_file

    from .. import _dist

    tensors: dict[str, torch.Tensor] = {}
    for prefix, src in sources.items():
        if isinstance(src, EMA):
            state = src.shadow
        elif isinstance(src, torch.nn.Module):
            state = unwrap(src).state_dict()
        else:
            state = dict(src)
        for key, value in state.items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            tensors[f"{prefix}.{key}"] = full.detach().cpu().contiguous()
    seen: set[int] = set()
    for name, t in tensors.items():
        # Tied weights (an LM head sharing the embedding) share memory, which safetensors
        # refuses: each tensor after the first of a storage is written as its own copy.
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            tensors[name] = t.clone()
        seen.add(ptr)
    if _dist.rank() == 0:
        save_file(tensors, os.fspath(path))
    return tensors


def write_trace(
    run_dir: str | os.PathLike[str],
    path: str | os.PathLike[str] | None = None,
    keys: tuple[str, ...] = TRACE_KEYS,
) -> list[dict[str, Any]]:
    """Write ``RUN/trace.jsonl``: one object per optimizer step of the log, with ``keys``."""
    records = [{k: rec.get(k) for k in keys} for rec in read_metrics(run_dir)]
    target = path if path is not None else os.path.join(run_dir, "trace.jsonl")
    with open(target, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return records
