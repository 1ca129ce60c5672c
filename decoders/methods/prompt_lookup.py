"""Prompt lookup decoding (Saxena 2023): the drafts are copied from the text so far. Find the
earliest earlier occurrence of the longest suffix n-gram (max_ngram tokens down to 1) and
propose the `num_tokens` tokens that followed it, as transformers' prompt lookup does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..core.contract import check, check_step, decode_one
from ..core.loop import Proposal
from ..core.tree import TokenTree


def earliest_continuation(ids: np.ndarray, max_ngram: int) -> int | None:
    """Where the text after the earliest earlier occurrence of the longest suffix n-gram of `ids` (max_ngram
    tokens down to 1) starts, or None: one comparison of the whole array per n-gram token, no Python loop
    over positions."""
    length = len(ids)
    for n in range(min(max_ngram, length - 1), 0, -1):
        hits = ids[:length - n] == ids[length - n]  # occurrences starting at i < length - n: not the suffix itself
        for j in range(1, n):
            hits &= ids[j:length - n + j] == ids[length - n + j]
        first = int(hits.argmax())
        if hits[first]:
            return first + n
    return None


class PromptLookup:  # the proposer: a chain copied from the committed text
    waits_for_prefill = False  # the prompt is text to copy from already

    def __init__(self, num_tokens: int, max_ngram: int, stop_ids):
        self.num_tokens, self.max_ngram, self.stop_ids = num_tokens, max_ngram, stop_ids
        self._ids, self._known = np.empty(1024, dtype=np.int64), 0  # the committed tokens converted so far

    def _array(self, sequence: Sequence[int]) -> np.ndarray:
        """`sequence` as an array; only the tokens committed since the last step are converted (the
        committed text only grows: another sequence is converted whole)."""
        n, known = len(sequence), self._known
        if n < known or (known and sequence[known - 1] != self._ids[known - 1]):
            known = 0
        if n > len(self._ids):
            self._ids = np.concatenate([self._ids[:known], np.empty(2 * n - known, dtype=np.int64)])
        self._ids[known:n] = sequence[known:n]
        self._known = n
        return self._ids[:n]

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        start = earliest_continuation(self._array(sequence), self.max_ngram)
        drafts = [] if start is None else list(sequence[start:start + min(self.num_tokens, room)])
        stops = [i for i, token in enumerate(drafts) if token in self.stop_ids]
        drafts = drafts[:stops[0]] if stops else drafts  # never draft past a stop token
        return Proposal(TokenTree.chain(sequence[-1], drafts))

    def commit(self, proposal, scores, path, sequence) -> dict:
        return {}


@dataclass
class PromptLookupDecoding:
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    num_tokens: int = 10  # draft tokens per step (hf_pld's prompt_lookup_num_tokens)
    max_ngram: int = 2  # longest suffix n-gram matched (hf_pld's max_matching_ngram_size)

    def __post_init__(self):
        check("num_tokens", self.num_tokens, at_least=1)
        check("max_ngram", self.max_ngram, at_least=1)
        self.widest_step = check_step(1 + self.num_tokens, f"1 + num_tokens {self.num_tokens}")

    def proposer(self, lm, prompt_ids, sampler, stop_ids):
        return PromptLookup(self.num_tokens, self.max_ngram, stop_ids), None

    generate = decode_one  # one prompt through the shared loop
