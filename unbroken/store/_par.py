"""Memory-bound work over many tensors, split across a few threads.

Copying and hashing release the GIL (torch's ``copy_``, ``os.preadv``, xxhash on large
buffers), so Python threads run them on several cores. On the 2-core dev VM of 2026-12-03 a
1 GB ``copy_`` took 0.152 s in one thread and 0.079 s in two; on the VM of 2026-12-02 torch's
own intra-op threads made a copy loop several times *slower* (store/_direct.py). The difference
is how the work is split: intra-op threads cut every tensor into fixed parts and wait for the
slowest (a descheduled vCPU stalls them all), while here each thread takes the next whole item
when it is free, so a stalled thread costs at most the one item it holds. Below ``MIN_BYTES``
the hand-offs cost more than they save and everything runs in the calling thread.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

MIN_BYTES = 64 << 20
MAX_THREADS = 4  # memcpy bandwidth is saturated by a few cores


def threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def each(
    items: Sequence[T], fn: Callable[[T], Any], nbytes: int, *, n_threads: int | None = None
) -> list[Any]:
    """``[fn(x) for x in items]``, in up to :func:`threads` threads when ``nbytes`` (the work's
    size) is worth it, or in ``n_threads`` (requests to a store: waiting, not memory-bound).
    The first exception is raised once every thread has stopped, so that no thread still
    writes into memory the caller goes on to use; no item is started after it. The helper
    threads are daemons: a process whose work is stuck (a store that never answers) can
    still exit, where a ``ThreadPoolExecutor``'s threads are joined at exit."""
    if n_threads is not None:
        n = max(1, min(n_threads, len(items)))
    else:
        n = threads() if nbytes >= MIN_BYTES and len(items) > 1 else 1
    if n == 1:
        return [fn(x) for x in items]
    out: list[Any] = [None] * len(items)
    order = itertools.count()  # next() of a count is atomic under the GIL
    errors: list[BaseException] = []

    def work() -> None:
        while not errors:
            i = next(order)
            if i >= len(items):
                return
            try:
                out[i] = fn(items[i])
            except BaseException as e:  # re-raised by the caller
                errors.append(e)
                return

    helpers = [
        threading.Thread(target=work, name="unbroken-copy", daemon=True) for _ in range(n - 1)
    ]
    for t in helpers:
        t.start()
    try:
        work()
    finally:
        for t in helpers:
            t.join()
    if errors:
        raise errors[0]
    return out
