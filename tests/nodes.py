"""Multi-node jobs on one machine: N torchrun agents, each under its own ``unbroken run``.

Each "node" is what ``srun`` starts on a node of a multi-node job: ``unbroken run -- torchrun
--nnodes N --nproc_per_node K --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT ...`` with
its own supervisor, its own snapshot area and SLURM's per-node variables (``SLURM_NODEID``,
``SLURM_NNODES``); the ranks meet through torchrun's c10d rendezvous on 127.0.0.1. The
scheduler's parts are simulated where they must be: ``scontrol`` is a script on ``PATH`` that
logs its arguments. The run directory is shared, as a cluster file system is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests import torchrun_helpers as tr
from tests.dist_launch import free_port
from tests.golden import tree_report
from tests.treesig import tree

FAKE_SCONTROL = '#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n'
JOB_ID = "4321"


@dataclass
class Job:
    """The nodes of one launch of a multi-node job (``start`` them, then ``finish``)."""

    tmp: Path
    run_dir: Path
    nodes: int
    per_node: int = 1
    slurm: bool = True
    supervisor: tuple[str, ...] = ()  # options of every node's `unbroken run`
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def node_command(self, i: int, port: int, *args: str) -> list[str]:
        rep = self.tmp / f"report-{len(self.procs) // self.nodes}-node{i}.json"
        launcher = [tr.TORCHRUN, "--nnodes", str(self.nodes)]
        launcher += ["--nproc_per_node", str(self.per_node), "--rdzv_backend", "c10d"]
        launcher += ["--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"job{port}"]
        script = [str(tr.SCRIPT), "--run-dir", str(self.run_dir), *args]
        return [*tr.supervised("--json", str(rep), *self.supervisor), *launcher, *script]

    def node_env(self, i: int) -> dict[str, str]:
        bindir = self.tmp / "bin"
        bindir.mkdir(exist_ok=True)
        (bindir / "scontrol").write_text(FAKE_SCONTROL)
        (bindir / "scontrol").chmod(0o755)
        extra = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
        extra["SCONTROL_LOG"] = str(self.scontrol_log)
        if self.slurm:
            extra |= {"SLURM_JOB_ID": JOB_ID, "SLURM_NODEID": str(i)}
            extra |= {"SLURM_NNODES": str(self.nodes), "SLURM_JOB_NUM_NODES": str(self.nodes)}
        return tr.env(**extra)

    @property
    def scontrol_log(self) -> Path:
        return self.tmp / "scontrol.log"

    def start(self, *args: str) -> list[subprocess.Popen[str]]:
        """Start every node of one launch of the job (the script's ``args``)."""
        port = free_port()
        launch = [
            tr.start(self.node_command(i, port, *args), self.node_env(i)) for i in range(self.nodes)
        ]
        self.procs += launch
        return launch

    def requeues(self) -> list[str]:
        log = self.scontrol_log
        return log.read_text().splitlines() if log.exists() else []


def signal_nodes(procs: list[subprocess.Popen[str]], sig: int) -> int:
    """``sig`` to every process of every node's tree, as a scheduler ends a job step."""
    pids = [p for proc in procs for p in tree(proc.pid)]
    sent = 0
    for p in pids:
        try:
            os.kill(p, sig)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def tree_env(proc: subprocess.Popen[str], name: str) -> set[str]:
    """The values of environment variable ``name`` in the processes of a node's tree."""
    out = set()
    key = name.encode() + b"="
    for pid in tree(proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        out.update(var[len(key) :].decode() for var in env if var.startswith(key))
    return out


def snapshot_areas(proc: subprocess.Popen[str]) -> set[str]:
    """The snapshot areas the processes of a node's tree were given (``UNBROKEN_SNAPSHOT_DIR``)."""
    return tree_env(proc, "UNBROKEN_SNAPSHOT_DIR")


def wait_for_attempt(proc: subprocess.Popen[str], attempt: int) -> None:
    """Until the node's supervisor has launched ``attempt`` (it persisted what it could of
    the previous one first), bounded by tr.HANG."""
    deadline = time.monotonic() + tr.HANG
    while str(attempt) not in tree_env(proc, "UNBROKEN_ATTEMPT"):
        assert proc.poll() is None, f"node exited {proc.returncode} before attempt {attempt}"
        # Where the node's processes wait, should it hang: seen once on a loaded machine (a
        # survivor of a lost node not relaunching within tr.HANG), not reproduced since.
        assert time.monotonic() < deadline, (
            f"attempt {attempt} never started; the node's processes:\n{tree_report(proc.pid)}"
        )
        time.sleep(0.05)


def lose_node(proc: subprocess.Popen[str]) -> set[str]:
    """A node dies: SIGKILL to every process of its tree, then its snapshot areas are gone
    (a dead node's memory is); returns the areas removed."""
    areas = snapshot_areas(proc)
    signal_nodes([proc], signal.SIGKILL)
    proc.wait(timeout=tr.HANG)
    for area in areas:  # and the channel beside it (unbroken/process/_shm.py): all of its memory
        subprocess.run(["rm", "-rf", area, area + ".run"], check=True)
    return areas
