"""The n-gram pool lookahead decoding verifies from: key token -> recent (N-1)-grams that followed it."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class NGramPool:
    """At most `per_key` n-grams per key (-1 = unbounded), least recently used evicted first."""

    def __init__(self, n: int, per_key: int):
        if n < 2:
            raise ValueError(f"an n-gram pool needs n >= 2, got {n}")
        self.n = n
        self.per_key = per_key
        self._grams: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, key: int, gram: Sequence[int]) -> None:
        """Store `gram` (the n-1 tokens after `key`), or mark it recently used if present."""
        if self.per_key == 0:
            return
        gram = tuple(gram)
        grams = self._grams.setdefault(key, OrderedDict())
        if gram in grams:
            grams.move_to_end(gram)
            return
        grams[gram] = None
        self._size += 1
        if 0 < self.per_key < len(grams):
            grams.popitem(last=False)
            self._size -= 1

    def add_from(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add every n-gram of `tokens` that starts at index >= start."""
        n = self.n
        for i in range(max(0, start), len(tokens) - n + 1):
            self.add(tokens[i], tokens[i + 1:i + n])

    def candidates(self, key: int) -> list[tuple[int, ...]]:
        """The n-grams stored after `key`, most recently used first."""
        grams = self._grams.get(key)
        return list(reversed(grams)) if grams else []
