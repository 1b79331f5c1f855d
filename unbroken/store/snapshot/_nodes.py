"""Snapshots of a job over several nodes: each node commits its part, and a buddy's copy.

A node's in-memory snapshot area is its own supervisor's, in its own memory: ranks on other
nodes cannot write into it. In a job over several nodes each node's area therefore holds a
*part* of every snapshot, committed by the node's first rank (its *leader*) with the store's
protocol (temporary name, manifest last, rename):

- the files its own ranks wrote (tensor files, ``rank-RRRRR.json``; rank 0's also the table),
- a copy of the files of its *source* node's ranks: node k's ranks send theirs to node k+1
  (mod the node count), rank by rank, over a gloo group of the job (:func:`exchange`), before
  any leader commits,
- ``state.json`` and the manifest of the whole checkpoint, built by rank 0 and handed to every
  leader, so every part names the same checkpoint (the same manifest checksum) and every file
  of it with its size and checksum.

Every file of a snapshot is thus in the memory of two nodes, and any one node can be lost:
after a death the supervisors copy what their parts hold into one staging directory in the
shared run directory, and the copy that completes the file set is verified against the
manifest and committed (store/snapshot/_area.py ``persist``). Two neighbouring nodes lost: back to
the durable checkpoint. Why over the job's process group and not between supervisors:
docs/design.md ("Buddy replicas").
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ... import _dist
from .. import _layout, _manifest
from .._safeio import safe_file
from .._store import _attempt

REPLICA_TAG = 7_000  # tags of the replica's point-to-point messages: REPLICA_TAG + file index


@dataclass(frozen=True)
class NodeLayout:
    """Who commits which part of a snapshot, for one rank of a job over several nodes."""

    leader: bool  # the first rank of this node: prepares and commits this node's part
    buddy: int  # the rank (on the next node) that keeps a copy of this rank's files
    sources: tuple[int, ...]  # the ranks (on the previous node) whose files this rank keeps
    nodes: int

    @classmethod
    def of(cls, areas: list[str], rank: int) -> NodeLayout | None:
        """From every rank's snapshot area (ranks of one node share one): None when all ranks
        share one area (one node: one area holds whole snapshots)."""
        order: list[str] = []
        for area in areas:
            if area not in order:
                order.append(area)  # nodes in the order of their first rank
        if len(order) < 2:
            return None
        members = {a: [r for r, b in enumerate(areas) if b == a] for a in order}

        def buddy_of(r: int) -> int:
            mine = members[areas[r]]
            nxt = members[order[(order.index(areas[r]) + 1) % len(order)]]
            return nxt[mine.index(r) % len(nxt)]

        buddies = [buddy_of(r) for r in range(len(areas))]
        leader = members[areas[rank]][0] == rank
        sources = tuple(r for r, b in enumerate(buddies) if b == rank)
        return cls(leader, buddies[rank], sources, len(order))


def save_part(
    store: Any,
    step: int,
    payload: Any,
    meta: dict[str, Any],
    layout: NodeLayout,
    group: Any,
    before_commit: Any = None,
) -> str:
    """Commit this node's part of the snapshot of ``step`` in ``store`` (its area's
    CheckpointStore); collective over the job. ``group`` is a gloo group of every rank, for
    the copies. Returns the part's path. Raises as CheckpointStore.save does, on every rank."""
    tmp = os.path.join(store.root, _layout.tmp_name(step))
    final = os.path.join(store.root, _layout.step_name(step))
    err: BaseException | None = None
    if layout.leader:
        err = _attempt(lambda: store._prepare(tmp))
    store._agree(err, tmp, step, group, owner=layout.leader)
    records: dict[str, tuple[int, str]] = {}
    err = _attempt(lambda: records.update(store._write_rank_files(tmp, payload, group)))
    store._agree(err, tmp, step, group, owner=layout.leader)
    everyone = _dist.all_gather_json(records, what="snapshot files", group=group)
    err = _attempt(lambda: exchange(tmp, everyone, layout, group))
    store._agree(err, tmp, step, group, owner=layout.leader)
    docs: list[Any] = []
    if _dist.rank() == 0:
        files = {k: (int(v[0]), str(v[1])) for part in everyone for k, v in part.items()}
        docs = list(_manifest.build(step, payload, files, meta, _dist.world_size()))
    state, manifest = _dist.broadcast_object(docs, what="snapshot manifest", group=group)
    err = None
    if before_commit is not None:  # a snapshot in the background: the training's verdict
        err = _attempt(before_commit)  # (never renames here: several processes)
        store._agree(err, tmp, step, group, owner=layout.leader)
    if layout.leader:
        err = _attempt(lambda: store._install(tmp, final, state, manifest))
    store._agree(err, tmp, step, group, owner=layout.leader)
    return final


def exchange(tmp: str, everyone: list[dict[str, Any]], layout: NodeLayout, group: Any) -> None:
    """Send this rank's files to its buddy and receive its sources' files into ``tmp``: each
    file read from and written into memory maps, so no copy is made on either side."""
    me = _dist.rank()
    pending = []
    keep = []  # the maps must outlive the transfers
    for i, name in enumerate(sorted(everyone[me])):
        size = int(everyone[me][name][0])
        if size:
            src = torch.from_file(safe_file(tmp, name), shared=False, size=size, dtype=torch.uint8)
            keep.append(src)
            pending.append(dist.isend(src, layout.buddy, group=group, tag=REPLICA_TAG + i))
    for source in layout.sources:
        for i, name in enumerate(sorted(everyone[source])):
            size = int(everyone[source][name][0])
            dst = _allocate(os.path.join(tmp, name), size)
            if dst is not None:
                keep.append(dst)
                pending.append(dist.irecv(dst, source, group=group, tag=REPLICA_TAG + i))
    # One deadline for all: a buddy that died is found by the agreement after this, which
    # names the missing rank.
    end = time.monotonic() + _dist.TIMEOUT
    for work in pending:
        if not _dist._wait(work, max(end - time.monotonic(), 0.001), "buddy copy"):
            raise TimeoutError(
                f"rank {me}: the copy of the snapshot to or from the buddy node did not "
                f"complete within {_dist.TIMEOUT:g} s"
            )
    del keep


def _allocate(path: str, size: int) -> torch.Tensor | None:
    """A new file of ``size`` bytes, its memory reserved first (a write into a full
    ``/dev/shm`` through a map would be a SIGBUS, not an error), mapped shared."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    if not size:
        return None
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
