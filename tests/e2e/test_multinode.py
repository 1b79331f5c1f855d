"""Two-node jobs on one machine (tests/nodes.py): two torchrun agents meeting through a c10d
rendezvous on 127.0.0.1, each under its own ``unbroken run`` with its own snapshot area, as ``srun``
starts one task per node. 1 rank per node, gloo; the run directory is shared. Checked: a scheduler's
SIGTERM to every process of both nodes stops both with 75 and requeues the job once, by whichever
node is left (node 0 lost included); a node lost mid-run (its whole tree SIGKILLed, its snapshot
area gone) costs at most one step -- the other node holds a copy of its part of the newest snapshot
-- and the relaunch, on two nodes or on one, ends bitwise equal to an uninterrupted run of the same
world size; without snapshots the same loss costs every step since the last durable save."""

from __future__ import annotations

import random
import signal
import socket
from pathlib import Path

import pytest

import unbroken
from tests import nodes
from tests import torchrun_helpers as tr
from tests.dist_launch import free_port
from tests.golden import assert_identical, resume_steps
from unbroken.store import CheckpointStore

STEPS = tr.STEPS  # 10 steps, a save every 3
SLOW = tr.SLOW


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: one node, 2 ranks (a world of 2, as the two-node job)."""
    return tr.reference_run(tmp_path_factory)


def _finish_all(procs: list) -> list[tuple[int, str]]:
    return [tr.finish(p) for p in procs]


def test_sigterm_to_every_process_of_a_two_node_job(tmp_path: Path, reference: Path) -> None:
    """scancel / preemption of a two-node job: every process of both nodes gets SIGTERM. Both
    nodes save the same step and exit 75; the job is requeued once (by node 0: a second
    ``scontrol requeue`` of a requeued job fails, and a node that then relaunched in place
    would wait for a rendezvous that never comes); the relaunch on two nodes ends bitwise."""
    job = nodes.Job(tmp_path, tmp_path / "run", nodes=2)
    launch = job.start(*SLOW)
    tr.wait_for_step(job.run_dir, 3, launch[0])
    nodes.signal_nodes(launch, signal.SIGTERM)
    ends = _finish_all(launch)
    assert [code for code, _ in ends] == [75, 75], "\n----\n".join(o[-3000:] for _, o in ends)
    assert job.requeues() == [f"requeue {nodes.JOB_ID}"]
    stopped = CheckpointStore(str(job.run_dir)).latest()
    assert stopped is not None and 3 <= stopped.step < 10 and stopped.world_size == 2
    stops = unbroken.read_metrics(str(job.run_dir), events=True)
    assert [r["step"] for r in stops if r.get("event") == "stop"] == [stopped.step]
    # The requeued job: both nodes again, to the end.
    job.slurm = False
    ends = _finish_all(job.start(*STEPS))
    assert [code for code, _ in ends] == [0, 0], "\n----\n".join(o[-3000:] for _, o in ends)
    assert_identical(reference, job.run_dir)


FAR = ["--steps", "10", "--save-every", "100"]  # no durable save before the end
# A snapshot at every step, whatever one costs on a loaded machine (the default interval keeps
# their cost within 2% of a step: on 2 shared cores that may be every few steps).
FAR_SLOW = [*FAR, "--step-sleep", "0.25", "--snapshot-every", "1"]


def _lose_node_1(job: nodes.Job, at: int) -> tuple[int, str]:
    """Node 1 dies after step ``at``: every process of its tree SIGKILLed, its snapshot area
    gone. Node 0's rank fails on the dead peer, its supervisor keeps what it can and relaunches
    in place, waiting in the rendezvous until the scheduler ends the failed job (SIGTERM to
    node 0's processes). Returns (the last step logged, what both nodes said)."""
    launch = job.start(*FAR_SLOW)
    tr.wait_for_step(job.run_dir, at, launch[0])
    areas = nodes.lose_node(launch[1])
    assert bool(areas) == ("--no-snapshots" not in job.supervisor), areas
    lost = max(r["step"] for r in unbroken.read_metrics(str(job.run_dir)))
    # The supervisor persists before it relaunches; the relaunch then waits for node 1.
    nodes.wait_for_attempt(launch[0], 2)
    nodes.signal_nodes([launch[0]], signal.SIGTERM)
    code, out = tr.finish(launch[0])
    assert code != 0, out[-4000:]
    return lost, out + tr.finish(launch[1])[1]


@pytest.mark.parametrize("relaunch", ["two-nodes", "one-node"])
def test_a_lost_node_loses_at_most_one_step(tmp_path: Path, reference: Path, relaunch: str) -> None:
    """Each node keeps its rank's part of every snapshot and a copy of the other node's
    (store/snapshot/_nodes.py). Node 1 is lost at a drawn step, with no durable save before the end:
    node 0's supervisor completes the newest snapshot from its own memory alone, commits it
    into the run directory, and the relaunch -- on two nodes, or on one with both ranks --
    resumes at most one step behind the last logged step and ends bitwise equal."""
    at = random.Random(f"{relaunch}-{tmp_path.name}").randint(2, 7)
    job = nodes.Job(tmp_path, tmp_path / "run", nodes=2, slurm=False)
    lost, said = _lose_node_1(job, at)
    assert "not persisted" not in said, said
    assert f"kept the in-memory snapshot of step {lost - 1}" in said or (
        f"kept the in-memory snapshot of step {lost}" in said
    ), said[-3000:]
    kept = CheckpointStore(str(job.run_dir)).latest()
    assert kept is not None and lost - 1 <= kept.step <= lost, (at, lost, kept, said[-3000:])
    assert kept.world_size == 2 and kept.meta.get("snapshot") is True
    if relaunch == "two-nodes":
        ends = _finish_all(job.start(*FAR))
        assert [c for c, _ in ends] == [0, 0], "\n----\n".join(o[-3000:] for _, o in ends)
    else:
        tr.run_to_end(job.run_dir, *FAR)  # one node, 2 ranks
    records = unbroken.read_metrics(str(job.run_dir), events=True)
    resumed = [r["step"] for r in records if r.get("event") == "resume"]
    assert resumed == [kept.step], records
    assert_identical(reference, job.run_dir)


def test_without_snapshots_a_lost_node_loses_every_step_since_the_last_save(
    tmp_path: Path, reference: Path
) -> None:
    """The same loss with in-memory snapshots off (``unbroken run --no-snapshots``, or the
    replicas' memory not to spare): nothing of the steps since the last durable save survives
    -- here, with no save before the end, the relaunch starts again from step 0."""
    job = nodes.Job(tmp_path, tmp_path / "run", nodes=2, slurm=False)
    job.supervisor = ("--no-snapshots",)
    lost, said = _lose_node_1(job, 4)
    assert lost >= 4
    assert CheckpointStore(str(job.run_dir)).latest() is None, said[-3000:]
    tr.run_to_end(job.run_dir, *FAR)
    records = unbroken.read_metrics(str(job.run_dir), events=True)
    assert not [r for r in records if r.get("event") == "resume"], records
    assert_identical(reference, job.run_dir)


def test_when_node_0_is_lost_the_node_left_requeues(tmp_path: Path, reference: Path) -> None:
    """Node 0 -- the node that used to be the only one to requeue -- is lost mid-run; node 1's
    rank fails on the dead peer, its supervisor keeps the newest snapshot and waits in the
    rendezvous, and then the scheduler stops the job (SIGTERM to node 1's processes). Node 1
    exits 75 and requeues the job, exactly once: whichever node is left claims the stop's
    requeue (a claim file created with O_EXCL in the shared run directory). The requeued job,
    on two nodes, resumes at most one step behind and ends bitwise equal."""
    job = nodes.Job(tmp_path, tmp_path / "run", nodes=2)
    launch = job.start(*FAR_SLOW)
    tr.wait_for_step(job.run_dir, random.Random(tmp_path.name).randint(2, 6), launch[0])
    assert nodes.lose_node(launch[0])
    lost = max(r["step"] for r in unbroken.read_metrics(str(job.run_dir)))
    nodes.wait_for_attempt(launch[1], 2)
    nodes.signal_nodes([launch[1]], signal.SIGTERM)
    code, out = tr.finish(launch[1])
    assert code == 75, out[-4000:]
    assert job.requeues() == [f"requeue {nodes.JOB_ID}"], out[-4000:]
    assert "node 0 requeues" not in out, out[-4000:]
    assert f"requeued SLURM job {nodes.JOB_ID}" in out, out[-4000:]
    kept = CheckpointStore(str(job.run_dir)).latest()
    assert kept is not None and lost - 1 <= kept.step <= lost, (lost, kept, out[-3000:])
    job.slurm = False
    ends = _finish_all(job.start(*FAR))
    assert [c for c, _ in ends] == [0, 0], "\n----\n".join(o[-3000:] for _, o in ends)
    records = unbroken.read_metrics(str(job.run_dir), events=True)
    assert [r["step"] for r in records if r.get("event") == "resume"] == [kept.step]
    assert_identical(reference, job.run_dir)


def _one_node(run_dir: Path, ranks: int, *args: str) -> tuple[int, str]:
    """One torchrun launch with ``ranks`` ranks on this node; (exit code, output)."""
    cmd = [tr.TORCHRUN, "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), str(tr.SCRIPT), "--run-dir", str(run_dir)]
    return tr.finish(tr.start([*cmd, *args]))


def test_three_nodes_the_survivors_merge_the_lost_nodes_part(tmp_path: Path) -> None:
    """Three nodes, one rank each: node k keeps its part and node k-1's. Node 1 is lost: no
    survivor holds every file -- node 0 has ranks 0 and 2, node 2 has ranks 2 and 1 -- so the
    two supervisors add what they hold to one merge in the run directory, and the second one
    completes, verifies and commits it. The relaunch on one node with 3 ranks ends bitwise
    equal to an uninterrupted run of 3 ranks (at 3 ranks DDP's reduction order after a resume
    is what train/_reduction.py fixes; before it, this compared with a run stopped at the
    kept step, since any resume differed in the last bits)."""
    job = nodes.Job(tmp_path, tmp_path / "run", nodes=3, slurm=False)
    launch = job.start(*FAR_SLOW)
    tr.wait_for_step(job.run_dir, random.Random(tmp_path.name).randint(3, 6), launch[0])
    assert nodes.lose_node(launch[1])
    lost = max(r["step"] for r in unbroken.read_metrics(str(job.run_dir)))
    survivors = [launch[0], launch[2]]
    for proc in survivors:
        nodes.wait_for_attempt(proc, 2)
    nodes.signal_nodes(survivors, signal.SIGTERM)
    said = "".join(tr.finish(p)[1] for p in launch)
    kept = CheckpointStore(str(job.run_dir)).latest()
    assert kept is not None and lost - 1 <= kept.step <= lost, (lost, kept, said[-4000:])
    assert "not persisted" not in said, said[-4000:]
    # Both added their part; the second one completed and committed it.
    notes = [tr.report(tmp_path / f"report-0-node{i}.json")["attempts"][0]["note"] for i in (0, 2)]
    assert sum(f"kept the in-memory snapshot of step {kept.step}" in n for n in notes) == 1, notes
    leftovers = [p.name for p in (job.run_dir / "checkpoints").iterdir() if p.name[0] == "."]
    assert leftovers == [], leftovers
    code, out = _one_node(job.run_dir, 3, *FAR)
    assert code == 0, out[-4000:]
    records = unbroken.read_metrics(str(job.run_dir), events=True)
    assert [r["step"] for r in records if r.get("event") == "resume"] == [kept.step]
    reference = tmp_path / "reference"  # uninterrupted, 3 ranks on one node
    code, out = _one_node(reference, 3, *FAR)
    assert code == 0, out[-4000:]
    assert resume_steps(reference) == []
    assert_identical(reference, job.run_dir)


@pytest.mark.parametrize(
    ("env", "mine"),
    [
        ({}, True),  # not SLURM, or one node: this supervisor requeues, nothing to claim
        ({"SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}, True),
        ({"SLURM_JOB_NUM_NODES": "x", "SLURM_NODEID": "1"}, True),
    ],
)
def test_one_node_requeues_without_a_claim(tmp_path: Path, env: dict[str, str], mine: bool) -> None:
    from unbroken.supervise._supervisor import claim_requeue

    assert claim_requeue(str(tmp_path), "7", env) == (mine, "", "")
    assert list(tmp_path.iterdir()) == []


def test_the_first_node_to_claim_a_stop_requeues_it(tmp_path: Path) -> None:
    """Several nodes: whichever node's supervisor claims the stop first requeues (node 2 here,
    with node 0 lost or late); every other node learns who did. The next allocation of the
    requeued job (SLURM_RESTART_COUNT) is a new stop with a claim of its own."""
    from unbroken.supervise._supervisor import REQUEUE_CLAIM, claim_requeue

    def env(node: int, restart: str | None = None) -> dict[str, str]:
        e = {"SLURM_NNODES": "3", "SLURM_NODEID": str(node)}
        return e | ({"SLURM_RESTART_COUNT": restart} if restart else {})

    run = str(tmp_path)
    assert claim_requeue(run, "7", env(2)) == (True, "", "")
    assert claim_requeue(run, "7", env(0))[:2] == (False, f"node 2 ({socket.gethostname()})")
    assert claim_requeue(run, "7", env(1))[0] is False
    assert claim_requeue(run, "8", env(1))[0] is True  # another job
    assert claim_requeue(run, "7", env(0, "1"))[0] is True  # the requeued job's next stop
    assert claim_requeue(run, "7", env(2, "1"))[0] is False
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{REQUEUE_CLAIM}{j}" for j in ("7.0", "7.1", "8.0")]


def test_without_a_run_directory_node_0_requeues(tmp_path: Path) -> None:
    """No Run told a run directory (or the claim cannot be written): node 0 requeues, said."""
    from unbroken.supervise._supervisor import claim_requeue

    env = {"SLURM_NNODES": "2"}
    assert claim_requeue(None, "7", env | {"SLURM_NODEID": "0"})[0] is True
    mine, who, why = claim_requeue(None, "7", env | {"SLURM_NODEID": "1"})
    assert (mine, who) == (False, "node 0") and "no run directory" in why
    missing = str(tmp_path / "gone")
    mine, who, why = claim_requeue(missing, "7", env | {"SLURM_NODEID": "1"})
    assert (mine, who) == (False, "node 0") and "cannot claim" in why
