"""Ports for the servers a test starts (a job's rendezvous, an S3 server) on 127.0.0.1.

A port the kernel hands out for ``bind(0)`` is free at that moment only: it comes from the
ephemeral range, the same range every outgoing connection takes its source port from (gloo's
pairs, the store's clients, the tests running beside it on the other xdist worker). A job
whose rendezvous port was taken in between does not always fail: its ranks may reach another
job's listener and wait there. So the suite takes its ports below the ephemeral range
(net.ipv4.ip_local_port_range), from a block of its own per xdist worker, never the same one
twice in a session, and only one nothing listens on now.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

_BLOCK = 1000  # ports per worker
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3"
    return int(name[2:]) if name[2:].isdigit() else 0


def _candidates() -> itertools.cycle[int]:
    lo = max(1024, _ephemeral_low() - (_worker() + 1) * _BLOCK)
    # start where an earlier session on this machine probably did not (TIME_WAIT leftovers)
    start = os.getpid() % _BLOCK
    return itertools.cycle([lo + (start + i) % _BLOCK for i in range(_BLOCK)])


_ports: itertools.cycle[int] | None = None


def free_port() -> int:
    """A port on 127.0.0.1 that nothing uses now and that no other test of this session was
    given (in a block of its own below the ephemeral range)."""
    global _ports
    with _lock:
        if _ports is None:
            _ports = _candidates()
        for _ in range(_BLOCK):
            port = next(_ports)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError(f"no free port below {_ephemeral_low()} on 127.0.0.1")
