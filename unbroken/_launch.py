"""Setting up torch.distributed from torchrun's or SLURM's environment."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import _dist
from .errors import ConfigError


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Initialize the default process group if the environment describes one.

    Reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), or
    SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the master address must be
    exported as ``MASTER_ADDR``/``MASTER_PORT``, e.g. from ``scontrol show hostnames``). With
    neither, or a world of one, nothing is initialized. Backend: NCCL with CUDA, else gloo.
    Returns (rank, world_size).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise ConfigError(
            "a distributed run needs MASTER_ADDR and MASTER_PORT in the environment "
            "(torchrun sets them; under srun export them yourself)"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    _dist.clean_exit()  # a finished rank exits 0 whatever the backend's teardown does
    _dist.start_liveness()  # a dead peer ends unbroken's waits for it (_dist._Liveness)
    return dist.get_rank(), dist.get_world_size()
