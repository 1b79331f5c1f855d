"""The torch settings a bitwise GPU resume needs: a check (a pure function) and an opt-in fix.

unbroken restores every bit of state, but a CUDA kernel that sums in a different order each
run (atomics in ``index_add_``, ``scatter_add_``, embedding and interpolation backward passes;
cuBLAS split-K reductions; cuDNN algorithms picked by timing) makes even an uninterrupted run
differ from itself. Then "the resumed run is not the uninterrupted one" says nothing about
state. :func:`problems` names each setting that allows that, with the fix; it only concerns
CUDA (torch's CPU kernels give the same bits run to run here).

    problems(read_settings())      # [] when a bitwise resume on this device is possible
    unbroken.make_deterministic()  # sets what can be set from inside the process
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..process import _log

log = _log.get()

CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_OK = (":4096:8", ":16:8")  # the values cuBLAS documents as deterministic


@dataclass(frozen=True, slots=True)
class DeterminismSettings:
    """The settings that decide whether CUDA kernels give the same bits run to run."""

    cuda: bool
    """A CUDA device is in use (otherwise nothing below matters)."""
    deterministic_algorithms: bool
    """``torch.are_deterministic_algorithms_enabled()``."""
    warn_only: bool
    """``torch.is_deterministic_algorithms_warn_only_enabled()``."""
    cublas_workspace: str | None
    """The ``CUBLAS_WORKSPACE_CONFIG`` environment variable."""
    cudnn_benchmark: bool
    """``torch.backends.cudnn.benchmark``."""
    cudnn_deterministic: bool
    """``torch.backends.cudnn.deterministic``."""
    nccl_world: int = 0
    """The world size when the default process group is NCCL's (0 otherwise)."""
    nccl_algo: str | None = None
    """The ``NCCL_ALGO`` environment variable."""


def problems(s: DeterminismSettings) -> list[str]:
    """What makes a bitwise resume impossible under ``s``, each with its fix ([] if none)."""
    if not s.cuda:
        return []
    out = []
    if not s.deterministic_algorithms:
        out.append(
            "torch.use_deterministic_algorithms is off: CUDA kernels that accumulate with "
            "atomics (index_add_, scatter_add_, embedding and interpolate backward, ...) give "
            "other bits on every run; call torch.use_deterministic_algorithms(True) at start-up "
            "(or unbroken.make_deterministic())"
        )
    elif s.warn_only:
        out.append(
            "torch.use_deterministic_algorithms(True, warn_only=True) lets kernels without a "
            "deterministic version run with a warning; drop warn_only (an error then names "
            "the kernel to replace)"
        )
    if s.cublas_workspace not in CUBLAS_OK:
        have = "unset" if s.cublas_workspace is None else f"{s.cublas_workspace!r}"
        out.append(
            f"{CUBLAS_VAR} is {have}: cuBLAS may then reduce in another order on every run; "
            f"export {CUBLAS_VAR}=:4096:8 before the process starts (cuBLAS reads it when "
            "it is first used)"
        )
    if s.cudnn_benchmark:
        out.append(
            "torch.backends.cudnn.benchmark is on: cuDNN picks its algorithms by timing them, "
            "so a resumed process may pick others; set torch.backends.cudnn.benchmark = False"
        )
    if not s.cudnn_deterministic and not s.deterministic_algorithms:
        out.append(
            "torch.backends.cudnn.deterministic is off: cuDNN may use non-deterministic "
            "algorithms; set torch.backends.cudnn.deterministic = True"
        )
    if s.nccl_world >= 3 and not s.nccl_algo:
        # At 2 ranks a + b = b + a: any algorithm gives the same sums.
        out.append(
            f"NCCL reduces across {s.nccl_world} ranks with the algorithm it picks from the "
            "topology it finds: a resume on the same nodes reduces as before, one on other "
            "nodes or GPUs may differ in the last bits; export NCCL_ALGO=Ring and "
            "NCCL_PROTO=Simple if the job may move (docs/distributed.md, 'What is bitwise where')"
        )
    return out


def read_settings(environ: Any = None) -> DeterminismSettings:
    """This process's settings (the torch boundary of :func:`problems`)."""
    import torch

    env = os.environ if environ is None else environ
    return DeterminismSettings(
        cuda=bool(torch.cuda.is_available() and torch.cuda.is_initialized()),
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cublas_workspace=env.get(CUBLAS_VAR),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        nccl_world=_nccl_world(),
        nccl_algo=env.get("NCCL_ALGO"),
    )


def _nccl_world() -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_world_size() if dist.get_backend() == "nccl" else 0


def determinism_problems() -> list[str]:
    """What in this process's torch settings makes a bitwise GPU resume impossible, each with
    its fix; [] on CPU or when all is set. ``Run`` warns with these at start-up on CUDA."""
    return problems(read_settings())


def warn_determinism() -> list[str]:
    """Log each of :func:`determinism_problems` as a warning (once a process); returns them."""
    found = determinism_problems()
    if found and not _warned:
        _warned.append(True)
        log.warning(
            "unbroken: on CUDA a resumed run can equal the uninterrupted one bit for bit only "
            "if the kernels are deterministic:\n  - %s",
            "\n  - ".join(found),
        )
    return found


_warned: list[bool] = []


def make_deterministic() -> None:
    """Set torch for bit-identical CUDA runs: deterministic algorithms (an error names a
    kernel that has none), cuDNN without autotuning, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
    unless already set. Call it at start-up, before CUDA is first used: cuBLAS reads its
    variable once, so setting it later is too late (a warning then says so).

    Example::

        unbroken.make_deterministic()
        model = Net().cuda()
    """
    import torch

    if os.environ.get(CUBLAS_VAR) not in CUBLAS_OK:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            log.warning(
                "unbroken.make_deterministic(): CUDA is already in use, so setting %s now may "
                "come too late for cuBLAS; export %s=:4096:8 before starting the process",
                CUBLAS_VAR,
                CUBLAS_VAR,
            )
        os.environ[CUBLAS_VAR] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
