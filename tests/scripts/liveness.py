"""Three gloo ranks for tests/process/test_liveness.py: a waiting rank waits in one of
unbroken's collectives on a group of two ranks (as a survivor waits for the other survivor)
while

- ``dead``: rank 0 waits; rank 2 is SIGKILLed and rank 1, alive, never joins (stuck elsewhere);
- ``host``: rank 1 waits; rank 0, which holds the job's rendezvous store, is SIGKILLed and
  rank 2, alive, never joins (node 0 lost);
- ``slow``: rank 0 waits; rank 1 joins only after many of rank 0's beats (slow, not dead);
- ``suspend``: rank 0 waits; rank 1 joins after 2 s, while the test stops every rank for a
  while (SIGSTOP, then SIGCONT, as a scheduler suspends a job);
- ``watchdog``: as ``dead``, but rank 0 waits in torch's own all-reduce (as in DDP's), under a
  watching Run, which only the watchdog can end (exit 1);
- ``ended``: rank 2 ends normally (its exit says so) while rank 0, watching, idles past the
  watchdog's time: not dead, nothing ends.

    python tests/scripts/liveness.py MODE DIR

The waiting rank writes DIR/waiting as it starts to wait and exits 0 when the collective
completes, 3 with the error's text on stderr when it raises; the others wait for DIR/done.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from unbroken import _dist
from unbroken.errors import CollectiveTimeoutError

mode, where = sys.argv[1], sys.argv[2]
_dist.BEAT, _dist.STALE_BEATS, _dist.FIRST_LOOK = 0.25, 8, 0.5  # judged after ~2 s
_dist.WATCHDOG_BEATS = 12  # 3 s without run.step()
_dist.set_timeout(60)
dist.init_process_group("gloo")
_dist.start_liveness()
_dist.watch(mode in ("watchdog", "ended"))  # what Run does
waiter, other, victim = (1, 2, 0) if mode == "host" else (0, 1, 2)
# torch's own ops on it end at 40 s (gloo's own timeout; 30 minutes by default)
pair = dist.new_group(sorted([waiter, other]), timeout=datetime.timedelta(seconds=40))
_dist.barrier(what="start")
me = dist.get_rank()


def wait_for_done() -> None:
    while not os.path.exists(os.path.join(where, "done")):
        time.sleep(0.05)


if mode == "ended":
    if me == 2:
        sys.exit(0)  # a normal end: atexit says so in the store
    if me == 0:
        time.sleep(6)  # 24 beats without run.step(), rank 2 ended: not stuck, not dead
        print("survived", file=sys.stderr)
        open(os.path.join(where, "done"), "w").close()
        sys.stderr.flush()
        os._exit(0)
    wait_for_done()
    os._exit(0)
if me == waiter and mode == "watchdog":
    t0 = time.monotonic()
    t = torch.zeros(1)
    try:
        dist.all_reduce(t, group=pair)  # never completes: only the watchdog ends this process
    except RuntimeError as e:
        print(f"the backend gave up after {time.monotonic() - t0:.1f} s: {e}", file=sys.stderr)
    open(os.path.join(where, "done"), "w").close()
    sys.stderr.flush()
    os._exit(4)
if me == waiter:
    open(os.path.join(where, "waiting"), "w").close()
    t0 = time.monotonic()
    try:
        _dist.any_true(False, pair, what="commit verdict")
        print(f"completed after {time.monotonic() - t0:.1f} s", file=sys.stderr)
        code = 0
    except CollectiveTimeoutError as e:
        took = time.monotonic() - t0
        print(f"raised after {took:.1f} s, missing {e.missing}: {e}", file=sys.stderr)
        code = 3
    open(os.path.join(where, "done"), "w").close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo's teardown with a dead peer is not what is tested
elif me == other:
    if mode in ("dead", "host", "watchdog"):
        wait_for_done()  # alive, beating, never in the pair's collective
    else:
        time.sleep(6 if mode == "slow" else 2)  # 24 of rank 0's beats when slow
        _dist.any_true(False, pair, what="commit verdict")
        wait_for_done()
else:
    if mode in ("dead", "host", "watchdog"):
        time.sleep(0.5)  # the waiter has started to wait
        os.kill(os.getpid(), signal.SIGKILL)
    wait_for_done()
os._exit(0)
