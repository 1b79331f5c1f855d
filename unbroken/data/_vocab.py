"""Two small vocabularies for examples and tests: characters, and whitespace-separated words.

Both reserve ids 0-3 for ``<pad>``, ``<unk>``, ``<s>`` (begin) and ``</s>`` (end); the other
tokens follow by decreasing count, ties in code-point order, so building from the same text
always gives the same ids. They are plain JSON (``to_json``/``from_json``, ``save``/``load``)::

    vocab = CharVocab.build(["hola", "adiós"])
    ids = vocab.encode("hola", eos=True)      # [.., .., .., .., 3]
    vocab.decode(ids)                          # 'hola'
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import ConfigError

SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")


class _Vocab:
    kind = "vocab"
    pad_id, unk_id, bos_id, eos_id = 0, 1, 2, 3

    def __init__(self, tokens: Sequence[str]) -> None:
        tokens = list(tokens)
        if tuple(tokens[: len(SPECIALS)]) != SPECIALS:
            raise ConfigError(f"a vocabulary's first tokens must be {list(SPECIALS)}")
        if len(set(tokens)) != len(tokens):
            raise ConfigError("a vocabulary's tokens must be distinct")
        self.tokens = tokens
        self._ids = {t: i for i, t in enumerate(tokens)}

    # subclasses define how text splits into tokens and how tokens join back
    @staticmethod
    def split(text: str) -> list[str]:
        raise NotImplementedError

    @staticmethod
    def join(tokens: list[str]) -> str:
        raise NotImplementedError

    @classmethod
    def build(cls, texts: Iterable[str], *, min_count: int = 1, max_size: int | None = None) -> Any:
        """A vocabulary of the tokens seen at least ``min_count`` times (the ``max_size`` most
        frequent, specials included)."""
        counts: Counter[str] = Counter()
        split = cls.split
        for text in texts:
            counts.update(split(text))
        for s in SPECIALS:
            counts.pop(s, None)
        ranked = sorted(
            (t for t, c in counts.items() if c >= min_count), key=lambda t: (-counts[t], t)
        )
        if max_size is not None:
            ranked = ranked[: max(0, max_size - len(SPECIALS))]
        return cls([*SPECIALS, *ranked])

    @classmethod
    def from_corpus(cls, corpus: Any, field: int = 0, **kwargs: Any) -> Any:
        """Build from one file of a :class:`unbroken.data.TextCorpus` (its raw text)."""
        return cls.build(corpus.texts(field), **kwargs)

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``; unknown tokens become ``unk_id``."""
        get, unk = self._ids.get, self.unk_id
        ids = [get(t, unk) for t in self.split(text)]
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; stops at ``</s>`` and drops ``<pad>``/``<s>`` when ``skip_special``."""
        out = []
        for i in ids:
            i = int(i)
            if skip_special:
                if i == self.eos_id:
                    break
                if i in (self.pad_id, self.bos_id):
                    continue
            out.append(self.tokens[i] if 0 <= i < len(self.tokens) else SPECIALS[self.unk_id])
        return self.join(out)

    # ---- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({"type": type(self).__name__, "version": 1, "tokens": self.tokens})

    @classmethod
    def from_json(cls, text: str) -> Any:
        data = json.loads(text)
        if data.get("type") != cls.__name__:
            raise ConfigError(f"this JSON holds a {data.get('type')!r}, not a {cls.__name__}")
        return cls(data["tokens"])

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Any:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Vocab) and type(other) is type(self) and other.tokens == self.tokens
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(self.tokens)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} tokens)"


class CharVocab(_Vocab):
    """Characters are tokens; ``decode(encode(s)) == s`` for text of known characters."""

    @staticmethod
    def split(text: str) -> list[str]:
        return list(text)

    @staticmethod
    def join(tokens: list[str]) -> str:
        return "".join(tokens)


class WordVocab(_Vocab):
    """Whitespace-separated words are tokens; ``decode`` joins them with single spaces."""

    @staticmethod
    def split(text: str) -> list[str]:
        return text.split()

    @staticmethod
    def join(tokens: list[str]) -> str:
        return " ".join(tokens)
