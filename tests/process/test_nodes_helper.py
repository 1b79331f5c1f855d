"""tests/nodes.py's ``wait_for_attempt``: a node already past the attempt waited for."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests import nodes


def test_a_node_already_past_the_attempt_is_not_waited_for() -> None:
    """The multi-node tests wait for their survivors one after the other; meanwhile a node's
    attempt 2 may have ended and attempt 3 be waiting in the rendezvous. Waiting for attempt 2
    must then return at once, not wait tr.HANG for an attempt that has come and gone."""
    env = {**os.environ, "UNBROKEN_ATTEMPT": "3"}
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = subprocess.Popen(cmd, env=env, text=True)
    try:
        t0 = time.monotonic()
        nodes.wait_for_attempt(proc, 2)
        assert time.monotonic() - t0 < 10
        assert nodes.attempts(proc) == {3}
    finally:
        proc.kill()
        proc.wait()
