"""Thin helpers over torch.distributed that are no-ops in a single process."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def barrier(group: Any = None) -> None:
    if active():
        dist.barrier(group=group)


def all_gather_object(obj: T, group: Any = None) -> list[T]:
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: T, src: int = 0) -> T:
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_true(flag: bool, group: Any = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (an agreement point)."""
    if not active():
        return flag
    device = _device(group)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def sum_floats(values: list[float]) -> list[float]:
    """Element-wise sum over ranks, in float64 (one collective)."""
    if not active():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]


def new_cpu_group() -> Any:
    """A gloo group over all ranks, for collectives of a background save (collective call)."""
    if not active():
        return None
    return dist.new_group(backend="gloo")


def _device(group: Any = None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
