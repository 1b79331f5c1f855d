"""Token-budget batching (Marian/fairseq "maxi-batches"), resumable exactly in O(window).

Epoch e's order of the samples is fixed by (seed, e) -- the dataset's own ``order(seed, e)``
when it has one (a :class:`~unbroken.data.TextCorpus`: full or chunked shuffle), else
``unbroken.data.epoch_order``. The order is cut into *windows* of ``window`` samples, and each
window, in turn:

1. is fetched in the main process (seeded per sample) and measured with ``length_fn``;
2. is sorted by length (stable, so ties keep their shuffled order);
3. is cut greedily into batches whose *padded* size -- number of samples x the longest
   one's length -- is at most ``max_tokens``;
4. has its batches' order shuffled from (seed, epoch, window start).

The position is (epoch, window start, batches of that window consumed), plus the size and
budget the window in progress was cut with. Resuming recomputes that one window and skips its
consumed batches: the work is O(window) whatever the position -- no batch is replayed (plus,
for an unchunked shuffle, the epoch's permutation, the same at any position). Changes of
``max_tokens`` or ``window`` take effect at the next window, so the window in progress
finishes as it began.

Batches are composed in the main process; workers only fetch their samples. So batches are
identical for any ``num_workers``. ``max_tokens`` is the *global* budget: with ``world_size``
W, rank r gets the contiguous slice ``[r*c//W, (r+1)*c//W)`` of a c-sample batch (split by
count; the batch is sorted by length, so the slices are alike), and the global stream does not
depend on W -- it may change between save and resume. A batch of fewer than W samples (only
possible when a sample is longer than ``max_tokens / W``) is skipped on every rank.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch.utils.data as tud

from .. import _dist
from ..errors import ConfigError, DataError
from ..process import _log
from . import _seeding, _workers
from ._corpus import EpochOrder
from ._windows import WindowFetch, cut_window, longest_field

log = _log.get("data")

TOKENS_VERSION = 1


@dataclass(slots=True)
class _Pos:
    """Where the stream stands inside an epoch."""

    start: int = 0  # epoch-order offset of the window in progress
    batch: int = 0  # batches of that window consumed
    size: int = 0  # that window's size and budget (meaningful when batch > 0)
    tokens: int = 0
    window: int = 0  # windows completed in this epoch (informational)


@dataclass(slots=True)
class _Window:
    start: int
    size: int
    tokens: int
    index: int
    batches: list[list[int]]


@dataclass(slots=True)
class _Plan:
    epoch: int
    pos: _Pos
    pending: deque[tuple[_Pos, list[int]]] = field(default_factory=deque)


class _Batches:
    """The batch sampler handed to torch's DataLoader; each pass follows the loader's plan."""

    def __init__(self, loader: TokenBatchLoader) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        plan = self._loader._plan
        assert plan is not None, "the loader sets a plan before iterating"
        return self._loader._stream(plan)


class TokenBatchLoader:
    """Batches of at most ``max_tokens`` padded tokens, resumable exactly; track it in a Run.

    ``dataset`` is map-style (e.g. a :class:`~unbroken.data.TextCorpus`). ``length_fn(item)``
    gives a sample's length in tokens (default: its longest field -- count BOS/EOS there if the
    collate function adds them). A sample longer than ``max_tokens`` raises
    :class:`unbroken.DataError` naming its file and line, or with ``too_long="skip"`` is left out
    of every epoch (counted in ``skipped``). Example::

        corpus = TextCorpus(["train.en", "train.es"], tokenize=[src.encode, tgt.encode])
        loader = TokenBatchLoader(corpus, max_tokens=4096, window=1000, seed=0,
                                  collate_fn=pad_pairs, num_workers=2)
        run = unbroken.Run("runs/mt", model=model, optimizer=opt, loader=loader, max_steps=1000)
        for src, tgt in run.loop(loader):
            ...

    When the corpus changed since a position was saved (its fingerprint differs), loading that
    position raises :class:`unbroken.DataError`; with ``restart_epoch_on_change=True`` it warns
    and restarts the epoch in progress from its start instead.
    """

    kind = "loader"
    rank_local = False

    def __init__(
        self,
        dataset: Any,
        max_tokens: int,
        *,
        window: int = 1000,
        seed: int = 0,
        shuffle: bool = True,
        length_fn: Callable[[Any], int] | None = None,
        too_long: str = "error",
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        reseed_globals: bool | str | Sequence[str] = True,
        restart_epoch_on_change: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if isinstance(dataset, tud.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ConfigError("TokenBatchLoader needs a map-style dataset with __len__")
        if too_long not in ("error", "skip"):
            raise ConfigError(f"too_long must be 'error' or 'skip', got {too_long!r}")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.length_fn = length_fn or longest_field
        self.too_long = too_long
        self.restart_epoch_on_change = bool(restart_epoch_on_change)
        self.rank = _dist.rank() if rank is None else int(rank)
        self.world_size = _dist.world_size() if world_size is None else int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world_size {self.world_size}")
        self._plan: _Plan | None = None
        self._restart = False
        self._max_tokens = self._window_len = 0
        self.max_tokens = max_tokens
        self.window = window
        self.epoch = 0
        self._pos = _Pos()
        self._ended = False  # as unbroken.MapLoader: a pass here ran to the epoch's end
        self._orders: dict[int, EpochOrder] = {}
        self.last_indices: list[int] = []
        """Dataset indices of the batch yielded last (every rank's slice; for a TextCorpus
        without skipped lines, its 0-based line numbers)."""
        self.yielded_batches = 0
        self.yielded_samples = 0
        self.windows_computed = 0
        self.skipped = 0
        """Process-local counters (not saved): batches, global samples, windows cut, samples
        left out as too long."""
        self._fetch = WindowFetch(dataset, self.seed, reseed_globals, keep=num_workers == 0)
        self._inner = _workers.inner_loader(
            self,
            self._fetch,
            _Batches(self),
            seed=self.seed,
            num_workers=num_workers,
            collate_fn=collate_fn or list,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
        )

    def close(self) -> None:
        """Shut down persistent worker processes (a later iteration starts new ones)."""
        _workers.shutdown(self._inner)

    # ---- configuration ------------------------------------------------------------------------

    @property
    def max_tokens(self) -> int:
        """The global token budget of a batch; a change applies from the next window."""
        return self._max_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self._max_tokens = self._set("max_tokens", value, self._max_tokens)

    @property
    def window(self) -> int:
        """Samples per window (maxi-batch); a change applies from the next window."""
        return self._window_len

    @window.setter
    def window(self, value: int) -> None:
        self._window_len = self._set("window", value, self._window_len)

    def _set(self, name: str, value: int, old: int) -> int:
        value = int(value)
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
        if value != old:
            self._restart = self._plan is not None  # prefetched windows used the old value
        return value

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next: from its start, or from the position if in progress."""
        if epoch != self.epoch:
            self.epoch, self._pos = int(epoch), _Pos()
            self._restart = self._plan is not None
        self._ended = False

    def epoch_finished(self) -> bool:
        return self._pos.start >= len(self.dataset)

    # ---- the stream ---------------------------------------------------------------------------

    def _order(self, epoch: int) -> EpochOrder:
        order = self._orders.get(epoch)
        if order is None:
            make = getattr(self.dataset, "order", None)
            if callable(make):
                order = make(self.seed, epoch, self.shuffle)
            else:
                order = EpochOrder(self.seed, epoch, len(self.dataset), shuffle=self.shuffle)
            self._orders = {epoch: order}  # one epoch cached
        return order

    def _where(self, index: int) -> str:
        where = getattr(self.dataset, "where", None)
        return where(index) if callable(where) else f"sample {index}"

    def _window(self, epoch: int, pos: _Pos) -> _Window | None:
        """Window at ``pos``: its batches (global dataset indices) in the order they are used."""
        n = len(self.dataset)
        if pos.start >= n:
            return None
        size, tokens = (pos.size, pos.tokens) if pos.batch > 0 else (self.window, self.max_tokens)
        size = min(size, n - pos.start)
        idx = self._order(epoch).slice(pos.start, pos.start + size)
        items = self._fetch.window(epoch, idx)
        lengths = np.array([max(1, int(self.length_fn(it))) for it in items], dtype=np.int64)
        fits = lengths <= tokens
        if not fits.all():
            if self.too_long == "error":
                j = int(np.argmin(np.where(fits, np.iinfo(np.int64).max, idx)))
                raise DataError(
                    f"{self._where(int(idx[j]))} is {int(lengths[j])} tokens long, more than "
                    f"max_tokens={tokens}; raise max_tokens, filter long lines out of the "
                    "corpus, or pass too_long='skip' to leave such samples out of every epoch"
                )
            self.skipped += int((~fits).sum())
            idx, lengths = idx[fits], lengths[fits]
        seed = _seeding.derive(self.seed, epoch, pos.start, domain=b"window")
        batches = cut_window(idx, lengths, tokens, seed if self.shuffle else None)
        self.windows_computed += 1
        return _Window(pos.start, size, tokens, pos.window, batches)

    def _stream(self, plan: _Plan) -> Iterator[list[tuple[int, int]]]:
        pos, epoch = plan.pos, plan.epoch
        while (win := self._window(epoch, pos)) is not None:
            nb = len(win.batches)
            for b in range(pos.batch, nb):
                glob = win.batches[b]
                if b + 1 < nb:
                    after = _Pos(win.start, b + 1, win.size, win.tokens, win.index)
                else:
                    after = _Pos(win.start + win.size, window=win.index + 1)
                if len(glob) < self.world_size:
                    continue  # too few to give every rank a sample: skipped on every rank
                plan.pending.append((after, glob))
                yield [(epoch, i) for i in self._local_slice(glob)]
            pos = _Pos(win.start + win.size, window=win.index + 1)

    def _local_slice(self, glob: list[int]) -> list[int]:
        n, w, r = len(glob), self.world_size, self.rank
        return glob if w == 1 else glob[r * n // w : (r + 1) * n // w]

    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch (the next one if a pass here finished it)."""
        if self._ended and self.epoch_finished():
            self.epoch, self._pos = self.epoch + 1, _Pos()
        self._ended = False
        while True:
            self._restart = False
            plan = _Plan(self.epoch, replace(self._pos))
            self._plan = plan
            try:
                for batch in _workers.start(self._inner, self):
                    self._pos, glob = plan.pending.popleft()
                    self.last_indices = glob
                    self.yielded_batches += 1
                    self.yielded_samples += len(glob)
                    yield batch
                    if self._restart:
                        break
                else:
                    self._pos = _Pos(len(self.dataset), window=self._pos.window)
                    self._ended = True
                    return
            finally:
                if self._plan is plan:
                    self._plan = None

    # ---- Stateful -----------------------------------------------------------------------------

    def _fingerprint(self) -> str | None:
        fp = getattr(self.dataset, "fingerprint", None)
        return None if fp is None else str(fp)

    def state_dict(self) -> dict[str, Any]:
        p = self._pos
        return {
            "version": TOKENS_VERSION,
            "epoch": self.epoch,
            "start": p.start,
            "batch": p.batch,
            "window_size": p.size,
            "window_tokens": p.tokens,
            "window": p.window,
            "ended": self._ended,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "chunk_lines": getattr(self.dataset, "chunk_lines", None),
            "dataset_len": len(self.dataset),
            "fingerprint": self._fingerprint(),
            "max_tokens": self.max_tokens,
            "window_len": self.window,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Store the position; the next ``iter()`` continues from it (deferred restore)."""
        sd = state_dict
        if sd.get("version") != TOKENS_VERSION:
            raise DataError(f"token loader state has version {sd.get('version')!r}")
        for key, now in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("chunk_lines", getattr(self.dataset, "chunk_lines", None)),
        ):
            if sd[key] != now:
                raise DataError(
                    f"token loader: {key} was {sd[key]!r} when saved but is {now!r} now, so the "
                    f"saved position would point at other samples; use the same {key}, or start "
                    "the data stream fresh (allow_missing=['<loader>'])"
                )
        self.epoch = int(sd["epoch"])
        self._ended = bool(sd["ended"])
        if self._changed(sd):
            finished = sd["start"] >= sd["dataset_len"]
            self._pos = _Pos(len(self.dataset)) if finished else _Pos()
            self._ended = self._ended and finished
        else:
            self._pos = _Pos(
                int(sd["start"]),
                int(sd["batch"]),
                int(sd["window_size"]),
                int(sd["window_tokens"]),
                int(sd["window"]),
            )
        self._restart = self._plan is not None

    def _changed(self, sd: dict[str, Any]) -> bool:
        """True (after a warning) when the dataset changed and the policy allows a restart."""
        fp, n = self._fingerprint(), len(self.dataset)
        same_fp = sd["fingerprint"] is None or fp is None or sd["fingerprint"] == fp
        if same_fp and sd["dataset_len"] == n:
            return False
        what = (
            f"fingerprint {sd['fingerprint']} then, {fp} now; {sd['dataset_len']} samples then, "
            f"{n} now"
        )
        if not self.restart_epoch_on_change:
            raise DataError(
                f"token loader: the corpus changed since this position was saved ({what}), so "
                "the position would point at other lines; restore the original files, or pass "
                f"restart_epoch_on_change=True to restart epoch {self.epoch} from its start, or "
                "start the data stream fresh (allow_missing=['<loader>'])"
            )
        _log.event(
            log,
            logging.WARNING,
            "unbroken: token loader: the corpus changed since this position was saved (%s); "
            "restarting epoch %d from its start (restart_epoch_on_change=True)",
            what,
            self.epoch,
        )
        return True
