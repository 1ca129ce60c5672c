"""Prompt lookup decoding (Saxena 2023): the drafts are copied from the text so far. Find the
earliest earlier occurrence of the longest suffix n-gram (max_ngram tokens down to 1) and
propose the `num_tokens` tokens that followed it, as transformers' prompt lookup does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..core.contract import check, check_step, decode_one
from ..core.loop import Proposal
from ..core.tree import TokenTree


class PromptLookup:  # the proposer: a chain copied from the committed text, no state between steps
    waits_for_prefill = False  # the prompt is text to copy from already

    def __init__(self, num_tokens: int, max_ngram: int, stop_ids):
        self.num_tokens, self.max_ngram, self.stop_ids = num_tokens, max_ngram, stop_ids

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        drafts: list[int] = []
        for n in range(min(self.max_ngram, len(sequence) - 1), 0, -1):
            suffix = list(sequence[-n:])
            start = next((i + n for i in range(len(sequence) - n) if list(sequence[i:i + n]) == suffix), None)
            if start is not None:
                drafts = list(sequence[start:start + min(self.num_tokens, room)])
                break
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
