"""Start a script as W ranks on 127.0.0.1 (torchrun's environment, without its agent), so a test
can signal one rank and read every rank's exit code."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests import forks
from tests.golden import ROOT
from tests.ports import free_port


def launch(
    script: Path,
    args: list[str],
    world: int,
    timeout: float = 240,
    allowed: tuple[int, ...] = (0, 75, -signal.SIGKILL),
    slurm: bool = False,
) -> tuple[list[int], list[str]]:
    """Run ``world`` ranks to the end; returns their exit codes (negative: killed by a signal)
    and stderr texts. Ranks still alive at the timeout are killed and the test fails: a hang
    is a bug. An exit code outside ``allowed`` fails the test with every rank's stderr.
    ``slurm``: describe the ranks as srun does (``SLURM_PROCID``/``SLURM_NTASKS``/
    ``SLURM_LOCALID``, with ``MASTER_ADDR``/``MASTER_PORT`` exported) instead of torchrun."""
    port = free_port()
    procs = []
    for rank in range(world):
        names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
        if not slurm:
            names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
        inherited = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env = {
            **inherited,
            "PYTHONPATH": str(ROOT),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            names[0]: str(rank),
            names[1]: str(rank),
            names[2]: str(world),
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",  # a hang's stacks (Launch.abort)
        }
        procs.append(forks.start(script, args, env))
    deadline = time.monotonic() + timeout
    outputs, codes = [], []
    for p in procs:
        try:
            code, _, err = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except forks.Hung as e:
            # this rank and those after it still run (those before it ended and were read)
            k = procs.index(p)
            stacks = [f"rank {k}: {e.text[-6000:]}"]
            stacks += [f"rank {i}: {q.abort()[-6000:]}" for i, q in enumerate(procs) if i > k]
            raise AssertionError(
                f"ranks hung past {timeout}s: {args}\n" + "\n----\n".join(stacks)
            ) from None
        codes.append(code)
        outputs.append(err)
    if any(c not in allowed for c in codes):
        raise AssertionError(f"exit codes {codes}\n" + "\n----\n".join(o[-3000:] for o in outputs))
    return codes, outputs
