"""tests/ports.py: rendezvous ports below the ephemeral range, a block per xdist worker, never
one twice, never one in use."""

from __future__ import annotations

import socket

from tests import ports


def test_ports_are_below_the_ephemeral_range_distinct_and_skip_one_in_use() -> None:
    low = ports._ephemeral_low()
    first = ports.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1 if first + 1 < low else first - 1))
        held.listen()
        taken = held.getsockname()[1]
        got = [ports.free_port() for _ in range(50)]
    assert all(p < low for p in [first, *got])
    assert len({first, *got}) == 51
    assert taken not in got
    worker = ports._worker()
    assert all(low - (worker + 1) * ports._BLOCK <= p < low - worker * ports._BLOCK for p in got)
