"""The choice of the resume (unbroken/train/_choice.py), as a table: listings in, a decision out.

``choose`` is pure: each row gives what the tiers hold -- each entry verified (True), failing
(its reason) or not verified yet (None) -- and the decision expected, or the error. A second
table plays the caller: it answers each ``check`` from a table of verdicts and records which
entries were verified, so the cost of a choice (how many checkpoints' metadata is read) is
checked too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from unbroken import ConfigError, CorruptCheckpointError
from unbroken.errors import CheckpointNotFoundError
from unbroken.store._entry import LOCAL, REMOTE, SNAPSHOT, Entry
from unbroken.train._choice import Decision, Listings, choose

ROOT = "/run/checkpoints"
STORE = "s3://b/p/checkpoints"


def e(tier: str, step: int, ok: bool | str | None = True) -> Entry:
    """An entry; ``ok`` a string: it fails for that reason."""
    where = f"{ROOT if tier == LOCAL else STORE if tier == REMOTE else '/dev/shm/a'}/{step}"
    if isinstance(ok, str):
        return Entry(step, tier, where, ok=False, why=ok)
    return Entry(step, tier, where, ok=ok)


def held(
    local: Sequence[Any] = (), remote: Sequence[Any] | None = None, snapshot: Sequence[Any] = ()
) -> Listings:
    """Listings from (step, ok) pairs, or steps (verified)."""

    def entries(tier: str, items: Any) -> tuple[Entry, ...]:
        pairs = [i if isinstance(i, tuple) else (i, True) for i in items]
        return tuple(e(tier, s, ok) for s, ok in sorted(pairs, key=lambda p: -p[0]))

    return Listings(
        local=entries(LOCAL, local),
        local_root=ROOT,
        remote=None if remote is None else entries(REMOTE, remote),
        remote_root=STORE if remote is not None else "",
        snapshot=entries(SNAPSHOT, snapshot),
    )


def steps(entries: tuple[Entry, ...]) -> list[tuple[str, int]]:
    return [(x.tier, x.step) for x in entries]


# (id, listings, choose's keywords, expected: {field: value} of the decision)
ROWS = [
    (
        "newest local verifies",
        held(local=[(10, True), (5, None)]),
        {},
        {"step": 10, "source": LOCAL, "set_aside": [], "check": []},
    ),
    (
        "newest local not verified yet: verify it first",
        held(local=[(10, None), (5, None)]),
        {},
        {"step": None, "check": [(LOCAL, 10)]},
    ),
    (
        "newest corrupt: set aside with its reason, the older one",
        held(local=[(10, "manifest.json truncated"), (5, True), (2, None)]),
        {},
        {
            "step": 5,
            "source": LOCAL,
            "set_aside": [(LOCAL, 10)],
            "why": ["manifest.json truncated"],
        },
    ),
    (
        "a load that failed is marked: set aside, the next older one",
        held(local=[(10, "failed its checksums while loading"), (5, True)]),
        {},
        {"step": 5, "set_aside": [(LOCAL, 10)], "why": ["failed its checksums while loading"]},
    ),
    (
        "remote newer than local: fetch it",
        held(local=[(5, True)], remote=[(10, True), (5, None)]),
        {},
        {"step": 10, "source": REMOTE, "upload": False, "set_aside": []},
    ),
    (
        "remote newer than local, not verified yet: verify it before the local one",
        held(local=[(5, None)], remote=[(10, None), (5, None)]),
        {},
        {"step": None, "check": [(REMOTE, 10)]},
    ),
    (
        "remote newer but corrupt: skipped (left in the store), the local one",
        held(local=[(5, True)], remote=[(10, "size mismatch"), (5, True)]),
        {},
        {"step": 5, "source": LOCAL, "skipped": [(REMOTE, 10)], "upload": False},
    ),
    (
        "local newer than remote: uploaded",
        held(local=[(10, True)], remote=[(5, None)]),
        {},
        {"step": 10, "source": LOCAL, "upload": True},
    ),
    (
        "the same step in both: does the store hold it? verify its copy",
        held(local=[(10, True)], remote=[(10, None)]),
        {},
        {"step": None, "check": [(REMOTE, 10)]},
    ),
    (
        "the same step in both, the store's verifies: the local one, no upload",
        held(local=[(10, True)], remote=[(10, True)]),
        {},
        {"step": 10, "source": LOCAL, "upload": False},
    ),
    (
        "the local copy of the newest step is corrupt: set aside, the store's fetched",
        held(local=[(10, "flipped byte"), (5, None)], remote=[(10, True)]),
        {},
        {"step": 10, "source": REMOTE, "set_aside": [(LOCAL, 10)]},
    ),
    (
        "snapshot newer than both: kept into the run directory, then uploaded",
        held(local=[(5, True)], remote=[(5, True)], snapshot=[(7, True)]),
        {},
        {"step": 7, "source": SNAPSHOT, "upload": True, "set_aside": []},
    ),
    (
        "snapshot of the newest local step: the local one (no copy)",
        held(local=[(7, True)], snapshot=[(7, None)]),
        {},
        {"step": 7, "source": LOCAL, "check": []},
    ),
    (
        "snapshot newer but of another run: skipped, the local one",
        held(local=[(5, True)], snapshot=[(7, "a snapshot of '/other'")]),
        {},
        {"step": 5, "source": LOCAL, "skipped": [(SNAPSHOT, 7)]},
    ),
    (
        "start_over: local abandoned, remote moved aside, nothing verified",
        held(local=[(10, None), (5, None)], remote=[(10, None)], snapshot=[(10, None)]),
        {"start_over": True},
        {"step": None, "abandon": True, "supersede": [(REMOTE, 10)], "check": []},
    ),
    (
        "start_over on an empty directory",
        held(),
        {"start_over": True},
        {"step": None, "abandon": True, "supersede": []},
    ),
    (
        "resume=STEP present: newer ones superseded in both tiers, older ones left",
        held(local=[(10, None), (5, True), (2, None)], remote=[(10, None), (5, True)]),
        {"resume": 5},
        {"step": 5, "source": LOCAL, "supersede": [(LOCAL, 10), (REMOTE, 10)], "upload": False},
    ),
    (
        "resume=STEP verified first",
        held(local=[(10, None), (5, None)]),
        {"resume": 5},
        {"step": None, "check": [(LOCAL, 5)]},
    ),
    (
        "resume=STEP only in the store: fetched, newer local ones superseded",
        held(local=[(10, None), (2, None)], remote=[(5, True)]),
        {"resume": 5},
        {"step": 5, "source": REMOTE, "supersede": [(LOCAL, 10)]},
    ),
    (
        "resume=STEP corrupt locally: set aside, the store's copy fetched",
        held(local=[(5, "truncated")], remote=[(5, True)]),
        {"resume": 5},
        {"step": 5, "source": REMOTE, "set_aside": [(LOCAL, 5)], "supersede": []},
    ),
    (
        "every tier empty: a fresh start",
        held(remote=[]),
        {},
        {"step": None, "source": None, "abandon": False, "check": [], "set_aside": []},
    ),
    (
        "only snapshots, none usable: a fresh start (no checkpoint of this run directory)",
        held(snapshot=[(3, "this node's area holds only its part of it")]),
        {},
        {"step": None, "skipped": [(SNAPSHOT, 3)]},
    ),
    (
        "only a snapshot, usable: kept",
        held(remote=[], snapshot=[(3, True)]),
        {},
        {"step": 3, "source": SNAPSHOT, "upload": True},
    ),
    (
        "resume=False on an empty directory and store",
        held(remote=[]),
        {"resume": False},
        {"step": None, "check": []},
    ),
]


@pytest.mark.parametrize(
    ("listings", "kw", "want"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_choose(listings: Listings, kw: dict[str, Any], want: dict[str, Any]) -> None:
    d = choose(listings, **kw)
    for name, value in want.items():
        if name == "why":
            assert [x.why for x in d.set_aside] == value, d
        elif name in ("set_aside", "supersede", "skipped", "check"):
            assert steps(getattr(d, name)) == value, (name, d)
        else:
            assert getattr(d, name) == value, (name, d)


# (id, listings, choose's keywords, error, words its message holds)
ERRORS = [
    (
        "none verifies locally: an error listing each, never a fresh start",
        held(local=[(10, "manifest.json truncated"), (5, "tensors-r00000.bin xxh3")]),
        {},
        CorruptCheckpointError,
        [
            "none of the 2 checkpoint(s) in /run/checkpoints can be loaded",
            f"{ROOT}/10: manifest.json truncated",
            f"{ROOT}/5: tensors-r00000.bin xxh3",
            "start_over=True",
        ],
    ),
    (
        "none verifies in the store, the run directory empty",
        held(remote=[(4, "size mismatch")]),
        {},
        CorruptCheckpointError,
        [f"none of the 1 checkpoint(s) in {STORE}", f"{STORE}/4: size mismatch", "remote="],
    ),
    (
        "none verifies in either tier (a usable snapshot of another run does not count)",
        held(local=[(4, "truncated")], remote=[(6, "bad"), (4, "bad")], snapshot=[(9, "other")]),
        {},
        CorruptCheckpointError,
        ["none of the 3 checkpoint(s) in /run/checkpoints and s3://b/p", "start_over=True"],
    ),
    (
        "resume=False with local checkpoints",
        held(local=[(3, None)]),
        {"resume": False},
        ConfigError,
        ["resume=False but /run/checkpoints already holds checkpoints", "start_over=True"],
    ),
    (
        "resume=False with remote checkpoints",
        held(remote=[(3, None)]),
        {"resume": False},
        ConfigError,
        [f"resume=False but {STORE} already holds checkpoints (steps [3]", "remote prefix"],
    ),
    (
        "resume=STEP absent from every tier",
        held(local=[(8, None), (4, None)], remote=[(6, None)]),
        {"resume": 5},
        CheckpointNotFoundError,
        ["no checkpoint for step 5 in /run/checkpoints (found steps [4, 8])", "found steps [6]"],
    ),
    (
        "resume=STEP present, corrupt in every tier",
        held(local=[(5, "truncated")], remote=[(5, "size mismatch")]),
        {"resume": 5},
        CorruptCheckpointError,
        ["truncated", f"its copy in {STORE}/5: size mismatch"],
    ),
]


@pytest.mark.parametrize(
    ("listings", "kw", "error", "words"), [r[1:] for r in ERRORS], ids=[r[0] for r in ERRORS]
)
def test_choose_refuses(listings: Listings, kw: dict[str, Any], error: type, words: list[str]):
    with pytest.raises(error) as ei:
        choose(listings, **kw)
    for w in words:
        assert w in str(ei.value), str(ei.value)


def _played(listings: Listings, verdicts: dict[tuple[str, int], bool | str], **kw: Any):
    """Choose as the Resumer does: answer each ``check`` from ``verdicts``; returns the
    decision and the entries verified, in order."""
    read: list[tuple[str, int]] = []
    d = choose(listings, **kw)
    while d.check:
        for x in d.check:
            read.append((x.tier, x.step))
            v = verdicts[(x.tier, x.step)]
            listings = listings.replaced(x.verified() if v is True else x.unusable(str(v)))
        d = choose(listings, **kw)
    return d, read


def test_a_choice_reads_what_walking_each_tier_newest_first_read() -> None:
    none = [(s, None) for s in (9, 6, 3)]
    # The newest verifies: one checkpoint's metadata read, whatever else there is.
    d, read = _played(held(local=none), {(LOCAL, 9): True})
    assert (d.step, read) == (9, [(LOCAL, 9)])
    # Two corrupt: read down to the first that verifies; step 3 is never read.
    d, read = _played(held(local=none), {(LOCAL, 9): "x", (LOCAL, 6): "y", (LOCAL, 3): True})
    assert d.step == 3 and read == [(LOCAL, 9), (LOCAL, 6), (LOCAL, 3)]
    d, read = _played(held(local=none), {(LOCAL, 9): "x", (LOCAL, 6): True})
    assert d.step == 6 and read == [(LOCAL, 9), (LOCAL, 6)]
    # With a store: its newest is read first when newer, the local tier below it never.
    remote = [(12, None), (9, None)]
    d, read = _played(held(local=none, remote=remote), {(REMOTE, 12): True})
    assert (d.step, d.source, read) == (12, REMOTE, [(REMOTE, 12)])
    d, read = _played(
        held(local=none, remote=remote), {(REMOTE, 12): "x", (LOCAL, 9): True, (REMOTE, 9): True}
    )
    assert (d.step, d.source, d.upload) == (9, LOCAL, False)
    assert read == [(REMOTE, 12), (LOCAL, 9), (REMOTE, 9)]


def test_after_a_failed_load_the_choice_falls_back_and_sets_it_aside() -> None:
    listings = held(local=[(9, True), (6, None)], remote=[(9, True)], snapshot=[(9, None)])
    d, _ = _played(listings, {})
    assert (d.step, d.source) == (9, LOCAL)
    why = "failed its checksums while loading (rank 1: tensors-r00001.bin)"
    marked = listings.unusable(LOCAL, 9, why).unusable(SNAPSHOT, 9, why)
    # The store's copy is another copy: fetched over the local one, which is set aside first.
    d, read = _played(marked, {})
    assert (d.step, d.source, steps(d.set_aside), read) == (9, REMOTE, [(LOCAL, 9)], [])
    assert d.set_aside[0].why == why
    # That copy failing too: the older local one, the snapshot reported.
    marked = marked.unusable(REMOTE, 9, "xxh3 mismatch while fetched")
    d, read = _played(marked, {(LOCAL, 6): True})
    assert (d.step, d.source, read) == (6, LOCAL, [(LOCAL, 6)])
    assert steps(d.set_aside) == [(LOCAL, 9)] and steps(d.skipped) == [(SNAPSHOT, 9), (REMOTE, 9)]
    assert d.upload is True


def test_decisions_are_values() -> None:
    assert choose(held()) == Decision()
    listings = held(local=[(4, True)])
    assert choose(listings) == choose(listings)  # the same listings, the same decision
