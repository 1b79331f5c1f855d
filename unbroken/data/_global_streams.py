"""Per-sample seeding of the global random streams, paid only for the streams a dataset uses.

``dataset[i]`` must see Python's, NumPy's and torch's global streams seeded from (seed, epoch,
i), so that its random augmentation does not depend on the worker count or the resume point.
Seeding all three for every sample costs several microseconds a sample; most datasets draw
from one stream or none. :class:`SampleSeeder` seeds the streams it was told to always, and
*watches* the others: before and after each batch it takes a fingerprint of every unseeded
stream, and when a fetch changed one (it drew from it) the stream joins the seeded ones and
the whole batch is fetched again, now seeded. A stream a fetch does not draw from cannot
affect what it returns, so a batch fetched with a stream unseeded is the batch it would have
been with it seeded -- the first batch that draws is the one that is fetched again. That
holds in any process at any point, so the bits never depend on when a stream was found.

What watching cannot see: a fetch that reads a global stream and puts it back (``getstate``,
draw, ``setstate``), or reads its state without drawing. Name the streams for such a dataset
(``reseed_globals="numpy"`` or all three), which seeds them for every sample.

NumPy's legacy global stream caches the second of each pair of Gaussians outside the
Mersenne Twister state, and reading its full state costs ~40 us. Its fingerprint is the MT
bytes (a copy through the bit generator's public ctypes interface) and, when a Gaussian is
cached at the batch start, the full state. Whether one is cached is read in full only when
the bytes changed since they were last seen without one: caching one takes a draw, and a
draw changes the bytes. (Only a ``set_state`` to a state with the very same MT words and a
cached Gaussian escapes that; a dataset that does so is the put-back case above.)
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from ..process import _log
from . import _seeding

log = _log.get("data")

_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos


def _np_mt() -> Callable[[], bytes] | None:
    """A reader of the global NumPy stream's MT19937 state bytes, or None where unavailable."""
    get = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25
    if get is None:
        return None
    try:
        gen = get()
        if not isinstance(gen, np.random.MT19937):
            return None
        addr = gen.ctypes.state_address
    except (AttributeError, TypeError):
        return None

    def read() -> bytes:
        if get() is not gen:  # np.random.set_bit_generator replaced it
            return b""
        return ctypes.string_at(addr, _MT_BYTES)

    return read


_NP_MT = _np_mt()
_np_clean = [b""]  # MT bytes last seen in a full state with no Gaussian cached


def _np_bytes() -> bytes:
    return _NP_MT() if _NP_MT is not None else b""


def _np_save() -> tuple[bytes, Any]:
    """NumPy's state as (MT bytes, the full state or None where the bytes determine it)."""
    mt = _np_bytes()
    if mt and mt == _np_clean[0]:
        return (mt, None)
    full: Any = np.random.get_state(legacy=False)
    if mt and not full["has_gauss"]:
        _np_clean[0] = mt
        return (mt, None)
    return (mt, full)


def _np_put(saved: tuple[bytes, Any]) -> None:
    mt, full = saved
    if full is None:  # the dict form: half the cost of the legacy tuple
        key = np.frombuffer(mt, dtype=np.uint32, count=624).copy()
        pos = int.from_bytes(mt[2496:], "little", signed=True)
        full = {
            "bit_generator": "MT19937",
            "state": {"key": key, "pos": pos},
            "has_gauss": 0,
            "gauss": 0.0,
        }
    np.random.set_state(full)


def _np_moved(saved: tuple[bytes, Any]) -> bool:
    mt, full = saved
    if _np_bytes() != mt:
        return True
    if full is None:
        return False
    now: Any = np.random.get_state(legacy=False)
    return not (
        full["has_gauss"] == now["has_gauss"]
        and full["gauss"] == now["gauss"]
        and full["state"]["pos"] == now["state"]["pos"]
        and np.array_equal(full["state"]["key"], now["state"]["key"])
    )


def _np_seed(s: int) -> None:
    np.random.seed(s & 0xFFFFFFFF)


def _torch_moved(saved: torch.Tensor) -> bool:
    return not torch.equal(torch.get_rng_state(), saved)


def _py_moved(saved: Any) -> bool:
    return bool(random.getstate() != saved)


class _Stream:
    """How to save, put back, check (moved since saved?) and seed one global stream."""

    __slots__ = ("save", "put", "moved", "seed")

    def __init__(
        self,
        save: Callable[[], Any],
        put: Callable[[Any], Any],
        moved: Callable[[Any], bool],
        seed: Callable[[int], Any],
    ) -> None:
        self.save, self.put, self.moved, self.seed = save, put, moved, seed


_ALL = {
    "python": _Stream(random.getstate, random.setstate, _py_moved, random.seed),
    "numpy": _Stream(_np_save, _np_put, _np_moved, _np_seed),
    "torch": _Stream(
        torch.get_rng_state, torch.set_rng_state, _torch_moved, torch.default_generator.manual_seed
    ),
}


class KeyedBatch(list[Any]):
    """A fetched batch's samples, with the (epoch, index) keys they were fetched for."""

    __slots__ = ("keys",)

    def __init__(self, items: Any, keys: Sequence[tuple[int, int]]) -> None:
        super().__init__(items)
        self.keys = list(keys)


class BatchSeeder:
    """A ``collate_fn`` run with the global streams seeded from its batch's keys.

    A collator that draws random numbers (masking tokens, a random crop) must draw the same
    ones for a batch whichever process collates it and wherever a run resumed: torch seeds a
    worker's streams per worker and per pass, and in the main process the collator would draw
    from the training stream at whatever moment the batch is fetched (a framework fetches a
    step's batches before it saves the step before). So the streams named by ``reseed``
    (True: all three; every batch, without watching: a collate is not run twice) are seeded
    from (seed, the batch's (epoch, index) keys) before each call, and in the main process put
    back after it, so the training stream goes on as if no batch had been collated.
    """

    def __init__(self, collate_fn: Callable[[Any], Any], seed: int, streams: Sequence[str]):
        self.collate_fn, self.seed, self.streams = collate_fn, seed, tuple(streams)

    @classmethod
    def wrap(cls, collate_fn: Any, seed: int, reseed: Any) -> Any:
        """``collate_fn`` seeded per batch (unchanged when None, the default collate, which
        draws nothing, or when ``reseed`` names no stream)."""
        streams = _seeding.streams_of(reseed)
        if collate_fn is None or not streams:
            return collate_fn
        return cls(collate_fn, seed, streams)

    def __call__(self, batch: Any) -> Any:
        if not isinstance(batch, KeyedBatch):
            return self.collate_fn(batch)
        streams = [_ALL[n] for n in self.streams]
        main = tud.get_worker_info() is None
        saved = [(st, st.save()) for st in streams] if main else []
        try:
            s = _seeding.batch_seed(self.seed, batch.keys)
            for st in streams:
                st.seed(s)
            return self.collate_fn(list(batch))
        finally:
            for st, state in saved:
                st.put(state)


class SampleSeeder:
    """Fetches samples with the global streams seeded per sample from (seed, epoch, index).

    ``reseed``: True -- every stream a fetch draws from, found by watching (module docstring);
    False/None -- none; a name or names -- exactly those, seeded for every sample.
    In the main process the streams are put back after each batch, so the training stream
    (dropout, say) is not disturbed; a worker process needs no putting back.
    """

    def __init__(self, seed: int, reseed: Any) -> None:
        self.seed = seed
        if reseed is True:
            self.seeded: tuple[str, ...] = ()
            self.watched: tuple[str, ...] = _seeding.STREAMS
        else:
            self.seeded = _seeding.streams_of(reseed)
            self.watched = ()

    @property
    def active(self) -> bool:
        """Whether any stream is seeded or watched (else fetching is the dataset's own)."""
        return bool(self.seeded or self.watched)

    def fetch(self, fetch_one: Callable[[int], Any], keys: Sequence[tuple[int, int]]) -> list[Any]:
        """``[fetch_one(index) for each key]``, each with the streams seeded from its key."""
        main = tud.get_worker_info() is None
        while True:
            seeded, watched = self.seeded, self.watched
            saved = {n: _ALL[n].save() for n in (seeded + watched if main else watched)}
            try:
                items = self._loop(fetch_one, keys, seeded)
            finally:
                used = tuple(n for n in watched if _ALL[n].moved(saved[n]))
                if main:  # the training stream (dropout, say) goes on as if nothing was fetched
                    for n in seeded + used:
                        _ALL[n].put(saved[n])
            if not used:
                return items
            # The batch drew from a stream in whatever state it was in: seed it from now on and
            # fetch the batch again (every sample of it, as the seeded batch would have been).
            log.debug("the dataset draws from the global %s stream(s): seeded per sample", used)
            self.seeded = tuple(n for n in _seeding.STREAMS if n in seeded or n in used)
            self.watched = tuple(n for n in watched if n not in used)

    def _loop(
        self,
        fetch_one: Callable[[int], Any],
        keys: Sequence[tuple[int, int]],
        seeded: tuple[str, ...],
    ) -> list[Any]:
        if not seeded:
            return [fetch_one(i) for _, i in keys]
        seeders = [_ALL[n].seed for n in seeded]
        out = []
        for (_, i), s in zip(keys, _seeding.sample_seeds(self.seed, keys), strict=True):
            for f in seeders:
                f(s)
            out.append(fetch_one(i))
        return out
