"""Line-aligned text corpora (one file, or source + target + ...) with O(1) access to any line.

Item ``i`` of a :class:`TextCorpus` is the tuple of line ``i`` of every file, decoded and without
its newline, each passed through the file's ``tokenize`` callable if one is given. The corpus is
map-style, so :class:`unbroken.MapLoader` (or :class:`unbroken.data.TokenBatchLoader`) shuffles
it per epoch from (seed, epoch) and resumes it exactly.

:class:`EpochOrder` is the epoch's order of the items: a full permutation fixed by (seed, epoch),
or -- for corpora larger than memory -- *chunked*: the chunks of ``chunk_lines`` consecutive
lines are shuffled, then the lines within each chunk, all from (seed, epoch). A slice of a chunked
order costs O(number of chunks + slice length), never O(corpus).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from ..errors import ConfigError, DataError
from . import _seeding
from ._index import LineIndex

CORPUS_VERSION = 1

Tokenize = Callable[[str], Any]


class EpochOrder:
    """The order of ``n`` items in epoch ``epoch``; ``slice(a, b)`` gives positions [a, b).

    With ``chunk_lines=None`` it is ``unbroken.data.epoch_order(seed, epoch, n, shuffle)`` (the
    permutation :class:`unbroken.MapLoader` uses), computed once. With ``chunk_lines=C``
    the chunks ``[0, C), [C, 2C), ...`` are permuted, then each chunk's lines, so a window of
    the order reads one or two chunks of the file (page-cache friendly) and only the chunks a
    slice touches are ever permuted::

        order = EpochOrder(seed=0, epoch=3, n=10_000_000, chunk_lines=100_000)
        first = order.slice(0, 1000)   # permutes 100 chunk ids and one chunk, not 10**7 lines
    """

    def __init__(
        self, seed: int, epoch: int, n: int, *, chunk_lines: int | None = None, shuffle: bool = True
    ) -> None:
        if chunk_lines is not None and chunk_lines < 1:
            raise ConfigError(f"chunk_lines must be >= 1, got {chunk_lines}")
        self.seed, self.epoch, self.n = int(seed), int(epoch), int(n)
        self.chunk_lines = chunk_lines if shuffle else None
        self.shuffle = shuffle
        self._full: np.ndarray | None = None
        self._chunks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._inner: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.n

    def slice(self, start: int, stop: int) -> np.ndarray:
        start, stop = max(0, start), min(self.n, stop)
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        if not self.shuffle:
            return np.arange(start, stop, dtype=np.int64)
        if self.chunk_lines is None:
            if self._full is None:
                self._full = _seeding.epoch_order(self.seed, self.epoch, self.n, True)
            return self._full[start:stop]
        return self._chunked(start, stop)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.slice(0, self.n)
        return out if dtype is None else out.astype(dtype)

    def _chunk_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._chunks is None:
            c = int(self.chunk_lines or 1)
            count = -(-self.n // c)
            seed = _seeding.derive(self.seed, self.epoch, domain=b"chunks")
            perm = np.random.Generator(np.random.PCG64(seed)).permutation(count)
            sizes = np.full(count, c, dtype=np.int64)
            sizes[-1] = self.n - (count - 1) * c
            ends = np.cumsum(sizes[perm])
            self._chunks = (perm, ends - sizes[perm], ends)
        return self._chunks

    def _within(self, chunk: int, size: int) -> np.ndarray:
        got = self._inner.get(chunk)
        if got is None:
            seed = _seeding.derive(self.seed, self.epoch, chunk, domain=b"chunk")
            got = np.random.Generator(np.random.PCG64(seed)).permutation(size)
            got += chunk * int(self.chunk_lines or 1)
            if len(self._inner) >= 4:  # a window touches one or two chunks
                self._inner.pop(next(iter(self._inner)))
            self._inner[chunk] = got
        return got

    def _chunked(self, start: int, stop: int) -> np.ndarray:
        perm, starts, ends = self._chunk_table()
        out = []
        k = int(np.searchsorted(ends, start, side="right"))
        while k < len(perm) and starts[k] < stop:
            lo, hi = int(starts[k]), int(ends[k])
            inner = self._within(int(perm[k]), hi - lo)
            out.append(inner[max(start, lo) - lo : min(stop, hi) - lo])
            k += 1
        return np.concatenate(out).astype(np.int64, copy=False)


class TextCorpus:
    """Line-aligned UTF-8 text files as a map-style dataset; item i = line i of every file.

    ``paths`` are one or more files with the same number of lines (a parallel corpus: source,
    target, ...). Each file gets an offset index, built on first use and cached beside it (or in
    ``cache_dir``), so any line is read in O(1). ``tokenize`` is a callable applied to every
    field, or one per file (``None`` leaves that field as text). Example::

        corpus = TextCorpus(["train.en", "train.es"])
        corpus[0]                      # ('The book of the genealogy ...', 'LIBRO de la ...')
        corpus = TextCorpus(["train.en", "train.es"], tokenize=[src.encode, tgt.encode])

    Bad inputs raise :class:`unbroken.DataError` naming the file and line (1-based): a missing
    file, files of different lengths, invalid UTF-8, and an empty line -- unless
    ``skip_empty=True``, which drops line i from *every* file when it is empty in any, so the
    files stay aligned (``line_number(i)`` maps an item back to its line).

    ``chunk_lines`` selects chunked shuffling for loaders that take the order from the corpus
    (:class:`unbroken.data.TokenBatchLoader`); ``max_lines`` keeps only the first N items.
    Tracked as a ``Run`` component, the corpus refuses to resume from a state saved with other
    contents (its :attr:`fingerprint` is the content hash of every file).
    """

    kind = "corpus"
    rank_local = False

    def __init__(
        self,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        tokenize: Tokenize | Sequence[Tokenize | None] | None = None,
        skip_empty: bool = False,
        chunk_lines: int | None = None,
        max_lines: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not paths:
            raise ConfigError("TextCorpus needs at least one file")
        if chunk_lines is not None and int(chunk_lines) < 1:
            raise ConfigError(f"chunk_lines must be >= 1, got {chunk_lines}")
        if max_lines is not None and int(max_lines) < 1:
            raise ConfigError(f"max_lines must be >= 1, got {max_lines}")
        cache = None if cache_dir is None else os.fspath(cache_dir)
        self.files = [LineIndex(p, cache) for p in paths]
        self.paths = [f.name for f in self.files]
        self.tokenize = self._tokenizers(tokenize)
        self.skip_empty = bool(skip_empty)
        self.chunk_lines = None if chunk_lines is None else int(chunk_lines)
        self.max_lines = None if max_lines is None else int(max_lines)
        self._keep = self._aligned_lines()
        n = len(self.files[0]) if self._keep is None else len(self._keep)
        self._n = n if self.max_lines is None else min(n, self.max_lines)
        if self._n == 0:
            raise DataError(f"corpus {', '.join(self.paths)} holds no lines")
        self.fingerprint = self._fingerprint()
        """xxh3 of every file's content hash and line count (plus skip_empty, max_lines)."""

    def _tokenizers(self, tokenize: Any) -> list[Tokenize | None]:
        if tokenize is None or callable(tokenize):
            return [tokenize] * len(self.files)
        tokenize = list(tokenize)
        if len(tokenize) != len(self.files):
            raise ConfigError(
                f"tokenize has {len(tokenize)} entries for {len(self.files)} files; give one "
                "callable for all, or one (or None) per file"
            )
        return tokenize

    def _aligned_lines(self) -> np.ndarray | None:
        """The kept line numbers (None: all); checks the files' lengths and empty lines."""
        first = self.files[0]
        for f in self.files[1:]:
            if len(f) != len(first):
                longer, shorter = (first, f) if len(first) > len(f) else (f, first)
                raise DataError(
                    f"line-aligned files differ in length: {first.name} has {len(first):,} "
                    f"lines but {f.name} has {len(f):,} (line {len(shorter) + 1:,} of "
                    f"{longer.name} has no partner in {shorter.name})"
                )
        empties = [f.empty_lines() for f in self.files]
        if not any(len(e) for e in empties):
            return None
        if self.skip_empty:
            drop = np.unique(np.concatenate(empties))
            return np.setdiff1d(np.arange(len(first), dtype=np.int64), drop, assume_unique=True)
        line, name = min(
            (int(e[0]), f.name) for e, f in zip(empties, self.files, strict=True) if len(e)
        )
        total = sum(len(e) for e in empties)
        raise DataError(
            f"{name}: line {line + 1} is empty ({total} empty line(s) in "
            f"{', '.join(self.paths)}); remove them, or pass skip_empty=True to drop every such "
            "line from all files (keeping them aligned)"
        )

    def _fingerprint(self) -> str:
        desc = {
            "version": CORPUS_VERSION,
            "files": [[f.meta["content_xxh3"], len(f)] for f in self.files],
            "skip_empty": self.skip_empty,
            "max_lines": self.max_lines,
        }
        return xxhash.xxh3_64_hexdigest(json.dumps(desc, sort_keys=True).encode())

    # ---- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    def _check(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"corpus item {i} out of range (0..{self._n - 1})")
        return i

    def line_number(self, i: int) -> int:
        """The 0-based line (in every file) of item ``i``; equal to ``i`` unless lines were
        skipped."""
        i = self._check(i)
        return i if self._keep is None else int(self._keep[i])

    def where(self, i: int) -> str:
        """``"line 13 of a.en, a.es"`` (1-based), for messages."""
        return f"line {self.line_number(i) + 1} of {', '.join(self.paths)}"

    def text(self, i: int) -> tuple[str, ...]:
        """Item ``i`` as decoded text, before tokenization."""
        line = self.line_number(i)
        return tuple(f.line(line) for f in self.files)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        fields = self.text(i)
        return tuple(
            t(s) if t is not None else s for t, s in zip(self.tokenize, fields, strict=True)
        )

    def texts(self, field: int = 0) -> Iterator[str]:
        """Every item's text of one file, in order (e.g. to build a vocabulary)."""
        f = self.files[field]
        for i in range(self._n):
            yield f.line(self.line_number(i))

    def order(self, seed: int, epoch: int, shuffle: bool = True) -> EpochOrder:
        """Epoch ``epoch``'s order of the items (chunked when ``chunk_lines`` is set)."""
        return EpochOrder(seed, epoch, self._n, chunk_lines=self.chunk_lines, shuffle=shuffle)

    @property
    def rebuilt(self) -> list[str]:
        """The files whose index this open built (first use, or changed since indexed)."""
        return [f.name for f in self.files if f.rebuilt]

    # ---- Stateful: a guard for loaders that do not record the fingerprint themselves --------

    def state_dict(self) -> dict[str, Any]:
        return {"version": CORPUS_VERSION, "fingerprint": self.fingerprint, "items": self._n}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != CORPUS_VERSION:
            raise DataError(f"corpus state has version {state_dict.get('version')!r}")
        if state_dict["fingerprint"] != self.fingerprint:
            raise DataError(
                f"corpus {', '.join(self.paths)} changed since the checkpoint was saved "
                f"(fingerprint {state_dict['fingerprint']} then, {self.fingerprint} now; "
                f"{state_dict['items']} items then, {self._n} now), so a saved data position "
                "would point at other lines; restore the original files, or start the data "
                "stream fresh (allow_missing=[...] for the loader and the corpus)"
            )

    def __repr__(self) -> str:
        return f"TextCorpus({self.paths!r}, items={self._n})"
