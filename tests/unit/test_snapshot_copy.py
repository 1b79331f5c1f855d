"""In-memory snapshots under the default ``snapshot_copy="step"``: every tensor is copied into
the snapshot at ``run.step()`` (the training waits for the copy), the rest -- hashing, the
table, the commit -- in the snapshot's thread while the next step computes. Exact by
construction: whatever the next step writes, and however (``.data``, ``.numpy()``,
``untyped_storage()``), is not in the snapshot; nothing is watched, no hook is installed.

Each test trains with a snapshot area and compares every snapshot the area commits with the
state of its step, bit for bit (``_train`` of test_snapshot_background.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_snapshot_background import _made, _train
from unbroken.store.snapshot import _slots
from unbroken.train import _snapshots


def _slow_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread dawdles once the copy is complete (before hashing and committing): the next
    step runs, and meddles, while the snapshot is still being written."""
    copied = _snapshots._Job.copied_all

    def slow(self: _snapshots._Job) -> None:
        copied(self)
        time.sleep(0.02)

    monkeypatch.setattr(_snapshots._Job, "copied_all", slow)


@pytest.mark.parametrize("how", [None, "data", "numpy", "numpy-kept", "storage", "inplace"])
def test_the_default_copy_is_exact_whatever_the_next_step_writes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, how: str | None
) -> None:
    made = _made(monkeypatch)
    _slow_thread(monkeypatch)
    threads: list[str] = []
    write = _slots.Slots.write_chunks

    def spy(self: _slots.Slots, path: str, tensors: Any) -> Any:
        threads.append(threading.current_thread().name)
        return write(self, path, tensors)

    monkeypatch.setattr(_slots.Slots, "write_chunks", spy)
    kept: list[Any] = []

    def meddle(model: torch.nn.Module) -> None:
        w = model[0].weight
        if how == "data":
            w.data.mul_(0.5)
        elif how == "numpy":
            w.detach().numpy()[:] *= 0.5
        elif how == "numpy-kept":  # an array made once, written every step (no watch sees it)
            if not kept:
                kept.append(w.detach().numpy())
            kept[0][:] *= 0.5
        elif how == "storage":
            s = w.untyped_storage()
            torch.tensor([], dtype=w.dtype).set_(s).mul_(0.5)
        elif how == "inplace":
            with torch.no_grad():
                w.mul_(0.5)

    steps = 10
    _, checked, _ = _train(
        tmp_path,
        monkeypatch,
        steps,
        meddle=meddle if how else None,
        snapshot_every=1,
        snapshot_copy="step",  # the default (RunConfig's, asserted below)
    )
    # Every snapshot read was its step's state (_train compared every tensor); none was
    # dropped (nothing to judge): after run.step(N), the newest is N-1 or already N.
    assert checked == sorted(checked) and checked[-1] >= steps - 1, checked
    assert all(n - 1 <= c <= n for n, c in enumerate(checked, start=2)), checked
    # The first sizes the slots in the step; the later ones are written by the thread.
    assert threads[0] == threading.main_thread().name
    assert set(threads[1:]) == {"unbroken-snapshot"}, threads
    import unbroken

    snaps = made[0]
    assert snaps.copy == "step" == unbroken.RunConfig().snapshot_copy
    assert snaps._watch is None and snaps._hook is None and snaps._sync == set()


def test_the_default_interval_is_chosen_once_from_the_copy_in_the_step(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    monkeypatch.setattr(_snapshots._log, "say", lambda log, msg, *a: said.append(msg % a))
    made = _made(monkeypatch)
    _, checked, _ = _train(tmp_path, monkeypatch, 3 + 2 * _snapshots.MEASURED, snapshot_copy="step")
    assert len([s for s in said if "in-memory snapshot every" in s]) == 1, said
    assert not [s for s in said if "background" in s], said
    # A snapshot every step until the choice: after run.step(N) the newest is N-1 or N.
    measured = checked[: _snapshots.MEASURED]
    assert all(n - 1 <= c <= n for n, c in enumerate(measured, start=2)), checked
    # What each snapshot cost the step includes the wait for the copy.
    assert made[0]._costs and all(c > 0 for c in made[0]._costs)


def test_close_commits_the_snapshot_in_flight(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.unit.test_snapshot_background import _newest

    states, _, area = _train(
        tmp_path, monkeypatch, 6, close_only=True, snapshot_every=1, snapshot_copy="step"
    )
    step, got = _newest(area)
    assert step == 6
    for k, want in states[step].items():
        assert torch.equal(got[k], want), k


def test_background_is_said_once_and_an_unknown_copy_is_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import unbroken
    from unbroken.errors import ConfigError

    with pytest.raises(ConfigError, match="snapshot_copy"):
        unbroken.RunConfig(snapshot_copy="thread")
    said: list[str] = []
    monkeypatch.setattr(_snapshots._log, "say", lambda log, msg, *a: said.append(msg % a))
    _train(tmp_path, monkeypatch, 4, snapshot_every=1, snapshot_copy="background")
    assert len([s for s in said if "snapshot_copy='background'" in s]) == 1, said


def test_a_committed_merge_drops_the_older_merges(tmp_path: Path) -> None:
    """Supervisors of a job over nodes add their parts of every snapshot they hold, newest
    first, to merges in the run directory; once one merge commits, the merges of older steps
    (and of another snapshot of the same step) can never be needed and are removed; a newer
    one may still complete and stays."""
    from unbroken.store import _layout
    from unbroken.store.snapshot._area import drop_older_parts

    root = tmp_path / "checkpoints"
    names = [
        _layout.part_name(3, "0123456789abcdef"),
        _layout.part_name(4, "fedcba9876543210"),
        _layout.part_name(5, "00112233445566ff"),
        _layout.step_name(4),
        _layout.step_name(2),
    ]
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "f").write_bytes(b"x")
    assert sorted(drop_older_parts(str(root), 4)) == sorted(names[:2])
    assert sorted(p.name for p in root.iterdir()) == sorted(names[2:])


def test_the_foreach_ops_unbroken_calls_are_there_and_exact() -> None:
    """``torch._foreach_copy_`` (the snapshot's copy in the step) and ``torch._foreach_lerp_``
    (EMA.update) are underscored torch ops: this fails loudly if a torch drops or changes them."""
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g).t(), torch.randn(4)[::2]]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    torch._foreach_copy_(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    avg, new = [torch.zeros(3)], [torch.full((3,), 2.0)]
    torch._foreach_lerp_(avg, new, 0.25)
    assert torch.equal(avg[0], torch.zeros(3).lerp(torch.full((3,), 2.0), 0.25))
