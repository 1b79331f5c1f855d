"""The process protocol: everything that passes between the supervisor, launchers and ranks.

Processes of one job talk through environment variables (set by whoever starts a process,
inherited by everything below it) and marker files. Every name is declared here and nowhere
else; each process reads the environment once, into a :class:`ProcessContext`, where it starts
the part that needs it (``Run()``, the supervisor, ``verify``). Torch-free: the supervisor
imports this.

==========================  ==================================  ==================================
variable                    set by                              read by
==========================  ==================================  ==================================
``UNBROKEN_SUPERVISED=1``   ``unbroken run``, for each launch   ``import unbroken``: stop signals
                                                                are handled from the first line
``UNBROKEN_ATTEMPT=<n>``    ``unbroken run`` (1-based)          the user's script, if it cares
``UNBROKEN_SNAPSHOT_DIR``   ``unbroken run`` (its private       ``Run``: in-memory snapshots go
                            area in ``/dev/shm``)               there
``UNBROKEN_STOP_DIR``       ``unbroken run`` / ``verify``, per  a rank that saved and stopped
                            launch                              writes its stop marker there
``UNBROKEN_JOB=<tag>``      ``unbroken run`` / ``verify``, per  ``_tree``: finds the launch's
                            launch                              processes after reparenting
``UNBROKEN_RUN_DIR``        ``unbroken verify``                 the user's script (where to run)
``UNBROKEN_KEEP_ALL=1``     ``unbroken verify``                 ``Run``: keep every checkpoint,
                                                                so both runs compare at every
                                                                save (logged, never silent)
``UNBROKEN_STANDBY=<fd>``   ``unbroken run``, for its warm      the first ``Run()``: wait until a
                            standby only (the read end of a     byte comes ("go": promoted) or
                            pipe it inherits)                   EOF (the supervisor is gone)
``UNBROKEN_STANDBY=<path>`` ``unbroken run``, for a standby     the same wait, on a FIFO each
                            torchrun (its workers inherit no    worker opens (one byte each)
                            fd)
``UNBROKEN_STANDBY=0``      the user, for ``unbroken run``      the supervisor: no standby (as
                                                                ``--no-standby``); ``deep``:
                                                                ``--standby deep``; ``imports``:
                                                                the default
==========================  ==================================  ==================================

Marker files: a rank that saved and stopped (or was stopped while not training) writes
``<UNBROKEN_STOP_DIR>/rank-RRRRR.json`` (:mod:`unbroken.process._stops`); the supervisor and
``verify`` read them, because a launcher between them and the ranks loses the ranks' exit code
(torchrun exits 1 when its ranks exit 75). With no snapshot area, a node's first rank also writes
``<UNBROKEN_STOP_DIR>/run-dir.json`` when ``Run`` opens: the supervisor judges a crash's
progress by that directory's checkpoints (with an area, its channel file says the same).

Set by others and only read here: torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``;
SLURM's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
``SLURM_JOB_ID``, ``SLURM_ARRAY_JOB_ID``, ``SLURM_ARRAY_TASK_ID``, ``SLURM_JOB_END_TIME``.

Exit codes: 0 done, 75 saved and stopped (relaunch), anything else a crash (:mod:`._exit`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

SUPERVISED = "UNBROKEN_SUPERVISED"
ATTEMPT = "UNBROKEN_ATTEMPT"
SNAPSHOT_DIR = "UNBROKEN_SNAPSHOT_DIR"
STOP_DIR = "UNBROKEN_STOP_DIR"
JOB_TAG = "UNBROKEN_JOB"
RUN_DIR = "UNBROKEN_RUN_DIR"
KEEP_ALL = "UNBROKEN_KEEP_ALL"
STANDBY = "UNBROKEN_STANDBY"

STOP_MARKER = "rank-{rank:05d}.json"
"""The stop marker of one rank, in the launch's stop directory."""

TORCHRUN_CHILD = "TORCHELASTIC_RUN_ID"
"""Set by torchrun in every worker's environment: a process with it was started by an agent."""


@dataclass(frozen=True)
class ProcessContext:
    """What this process was told by whoever launched it (read once, where it is needed)."""

    supervised: bool = False
    attempt: int | None = None
    snapshot_dir: str | None = None
    stop_dir: str | None = None
    job_tag: str | None = None
    run_dir: str | None = None
    keep_all: bool = False
    under_torchrun: bool = False
    standby_fd: int | None = None
    """A warm standby's pipe (docs/supervise.md): the first ``Run()`` waits on it."""
    standby_fifo: str | None = None
    """A standby torchrun's FIFO (an absolute path): each worker waits on it, as on the pipe."""

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> ProcessContext:
        e = os.environ if env is None else env
        attempt, standby = e.get(ATTEMPT, ""), e.get(STANDBY, "")
        return cls(
            supervised=e.get(SUPERVISED) == "1",
            attempt=int(attempt) if attempt.isdigit() else None,
            snapshot_dir=e.get(SNAPSHOT_DIR) or None,
            stop_dir=e.get(STOP_DIR) or None,
            job_tag=e.get(JOB_TAG) or None,
            run_dir=e.get(RUN_DIR) or None,
            keep_all=e.get(KEEP_ALL) == "1",
            under_torchrun=TORCHRUN_CHILD in e,
            # fds 0-2 are never the pipe: UNBROKEN_STANDBY=0 is the user's opt-out, not a fd
            standby_fd=int(standby) if standby.isdigit() and int(standby) > 2 else None,
            standby_fifo=standby if os.path.isabs(standby) else None,
        )


def launch_env(base: Mapping[str, str], *, job_tag: str, stop_dir: str) -> dict[str, str]:
    """The environment of one launch (``unbroken run`` or ``verify``): ``base`` plus the
    launch's tag and stop-marker directory."""
    return {**base, JOB_TAG: job_tag, STOP_DIR: stop_dir}


def supervised_env(
    base: Mapping[str, str], *, attempt: int, snapshot_dir: str | None
) -> dict[str, str]:
    """What ``unbroken run`` tells the command it supervises (never a standby marker: the
    user's opt-out, or one inherited from an outer supervisor, is not passed on)."""
    env = {k: v for k, v in base.items() if k != STANDBY}
    env.update({ATTEMPT: str(attempt), SUPERVISED: "1"})
    if snapshot_dir is not None:
        env[SNAPSHOT_DIR] = snapshot_dir
    return env


def verify_env(base: Mapping[str, str], *, run_dir: str) -> dict[str, str]:
    """What ``unbroken verify`` tells the command it runs twice."""
    return {**base, RUN_DIR: run_dir, KEEP_ALL: "1"}
