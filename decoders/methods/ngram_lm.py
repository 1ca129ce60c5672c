"""A count-based n-gram LM over token ids, for rescoring BPD's top-k lattice (Kim et al. 2024).

Scores are stupid backoff (Brants et al. 2007): the relative frequency of the longest context
seen with the token, times 0.4 per order backed off, down to add-one unigrams. It is not a
normalised distribution, which rescoring does not need: it ranks continuations. Counts of
orders >= 3 that occur once are dropped (`min_count`) to keep the file small.
"""
from __future__ import annotations

import functools
import gzip
import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Sequence

NGRAM_FORMAT = "ngram-lm-v1"
BACKOFF = 0.4


class NgramLM:
    def __init__(self, order: int, vocab_size: int):
        if not (isinstance(order, int) and order >= 1):
            raise ValueError(f"n-gram order must be an integer >= 1, got {order!r}")
        self.order = order
        self.vocab_size = vocab_size
        # counts[m][context of m tokens] = {next token: count}, for m = 0 .. order - 1
        self.counts: list[dict[tuple, dict[int, int]]] = [defaultdict(dict) for _ in range(order)]
        self.totals: list[dict[tuple, int]] = [defaultdict(int) for _ in range(order)]
        self.info: dict = {}

    @classmethod
    def train(cls, sequences: Iterable[Sequence[int]], order: int, vocab_size: int, min_count: int = 2) -> "NgramLM":
        lm = cls(order, vocab_size)
        raw = [Counter() for _ in range(order)]
        for seq in sequences:
            seq = list(seq)
            for i in range(len(seq)):
                for m in range(min(order, i + 1)):
                    raw[m][tuple(seq[i - m:i + 1])] += 1
        for m, counter in enumerate(raw):
            floor = min_count if m >= 2 else 1
            for gram, c in counter.items():
                if c >= floor:
                    lm._add(gram, c)
        return lm

    def _add(self, gram: tuple, count: int) -> None:
        m = len(gram) - 1
        self.counts[m][gram[:-1]][gram[-1]] = count
        self.totals[m][gram[:-1]] += count

    def score(self, context: Sequence[int], token: int) -> float:
        """log of the stupid-backoff score of `token` after `context`."""
        factor = 1.0
        context = tuple(context[len(context) - (self.order - 1):]) if self.order > 1 else ()
        for m in range(len(context), 0, -1):
            ctx = context[len(context) - m:]
            seen = self.counts[m].get(ctx)
            if seen and token in seen:
                return math.log(factor * seen[token] / self.totals[m][ctx])
            factor *= BACKOFF
        unigrams = self.counts[0].get((), {})
        return math.log(factor * (unigrams.get(token, 0) + 1) / (self.totals[0].get((), 0) + self.vocab_size))

    def size(self) -> int:
        return sum(len(nexts) for table in self.counts for nexts in table.values())

    def save(self, path: str | Path, info: dict) -> None:
        grams = [[list(ctx) + [tok, c] for ctx, nexts in table.items() for tok, c in nexts.items()]
                 for table in self.counts]
        payload = {"format": NGRAM_FORMAT, "order": self.order, "vocab_size": self.vocab_size, "info": info,
                   "grams": grams}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt") as f:
            json.dump(payload, f, separators=(",", ":"))

    @classmethod
    def load(cls, path: str | Path) -> "NgramLM":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"decoder.ngram: no n-gram LM at {path}; train one with scripts/train_ngram.py")
        try:
            with gzip.open(path, "rt") as f:
                payload = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"decoder.ngram: {path} is not a gzipped n-gram LM ({e})") from None
        if payload.get("format") != NGRAM_FORMAT:
            raise ValueError(f"decoder.ngram: {path} is not an n-gram LM (format {payload.get('format')!r})")
        lm = cls(int(payload["order"]), int(payload["vocab_size"]))
        for table in payload["grams"]:
            for row in table:
                lm._add(tuple(row[:-1]), row[-1])
        lm.info = payload.get("info", {})
        return lm

    @classmethod
    def shared(cls, path: str | Path) -> "NgramLM":
        """The LM in `path`, loaded once per process while the file stays the same, for read-only
        users: a leaderboard's entries and datasets share it (a load takes seconds)."""
        path = Path(path).resolve()
        stat = path.stat() if path.is_file() else None
        return _shared(path, stat and (stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _shared(path: Path, stamp: tuple | None) -> NgramLM:  # stamp: a changed file is loaded again
    return NgramLM.load(path)
