"""Who keeps whose part of a snapshot in a job over several nodes (store/snapshot/_nodes.py)."""

from __future__ import annotations

import pytest

from unbroken.store.snapshot._nodes import NodeLayout


def _all(areas: list[str]) -> list[NodeLayout | None]:
    return [NodeLayout.of(areas, r) for r in range(len(areas))]


def test_one_area_means_whole_snapshots() -> None:
    assert _all(["a", "a", "a"]) == [None, None, None]


def test_two_nodes_of_two_ranks_keep_each_others_part() -> None:
    got = _all(["a", "a", "b", "b"])
    assert [(x.leader, x.buddy, x.sources) for x in got if x] == [
        (True, 2, (2,)),
        (False, 3, (3,)),
        (True, 0, (0,)),
        (False, 1, (1,)),
    ]


@pytest.mark.parametrize(
    "areas",
    [
        ["a", "b", "c"],
        ["a", "a", "b", "b", "c", "c"],
        ["a", "a", "a", "b"],  # nodes of different sizes
        ["a", "b", "b", "b", "c"],
        ["b", "a", "b", "a"],  # ranks of a node need not be contiguous
    ],
)
def test_every_rank_has_a_buddy_on_the_next_node_and_any_one_node_can_be_lost(
    areas: list[str],
) -> None:
    got = _all(areas)
    layouts = [x for x in got if x is not None]
    assert len(layouts) == len(areas)
    order = list(dict.fromkeys(areas))
    for r, x in enumerate(layouts):
        nxt = order[(order.index(areas[r]) + 1) % len(order)]
        assert areas[x.buddy] == nxt
        assert all(layouts[s].buddy == r for s in x.sources)
        assert x.nodes == len(order)
    assert sum(x.leader for x in layouts) == len(order)
    for lost in order:  # every rank's files survive on its own node or its buddy's
        for r in range(len(areas)):
            assert areas[r] != lost or areas[layouts[r].buddy] != lost
