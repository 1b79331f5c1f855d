"""Thin helpers over torch.distributed that are no-ops in a single process."""

from __future__ import annotations

import atexit
import ctypes
import gc
import sys
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


_exit_guarded = False


def clean_exit() -> None:
    """Make this process's exit safe from the backend's teardown: a finished or stopped rank
    exits with its own status (0, 75, ...), never with the abort that a gloo group left alive
    into the interpreter's teardown can cause ("terminate called without an active exception",
    -6: a gloo thread dropping the last reference to a tensor needs the GIL, which a finalizing
    interpreter no longer hands out; the same in C++ static destructors). Called by
    ``init_distributed()`` and by ``Run()`` when several ranks train; idempotent.

    At exit (``atexit``, interpreter alive, every save thread joined): destroy the process
    groups and collect the garbage that still holds them, so their threads are joined now;
    then have C's ``exit()`` end the process with its status before the native libraries'
    static destructors run (glibc ``on_exit``, registered last so it runs first).
    """
    global _exit_guarded
    if _exit_guarded or not active() or dist.get_world_size() < 2:
        return
    _exit_guarded = True
    atexit.register(_teardown)


def _teardown() -> None:
    if active():
        try:
            dist.destroy_process_group()
        except Exception:  # an exit goes on: a group that cannot be destroyed is skipped
            pass
    gc.collect()
    _skip_native_destructors()


def _skip_native_destructors() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        on_exit = libc.on_exit  # glibc: handler(status, arg), run LIFO by exit()
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)  # _exit(status)
    except (OSError, AttributeError):
        pass  # not glibc: the teardown runs as usual
