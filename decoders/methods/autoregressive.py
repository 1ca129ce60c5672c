"""Autoregressive decoding: one token per target forward, KV-cached. The baseline every ratio uses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..core.lm import LM
from ..core.loop import Proposal
from ..core.tree import TokenTree
from ..core.sampling import Sampling, next_token
from ..core.trace import Generation, Tracer


def autoregressive_decode(lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                          stop_ids) -> Generation:
    tracer = Tracer(lm.sync)
    cache = lm.new_cache()
    warpers = sampling.warpers()
    generator = sampling.generator(lm.device)
    tokens: list[int] = []
    feed = list(prompt_ids)
    while True:
        context = len(cache)
        with tracer.target():
            logits = lm.forward(feed, cache, last_only=True)[-1]
        token = next_token(logits, sampling, generator, warpers)
        tokens.append(token)
        tracer.end_step(accepted=1, forward_tokens=len(feed), context_tokens=context)
        if token in stop_ids or len(tokens) >= max_new_tokens:
            return tracer.finish(tokens, stop_ids)
        feed = [token]


def reference_logits(lm: LM, prompt_ids: Sequence[int], tokens: Sequence[int], at: int) -> torch.Tensor:
    """The next-token logits autoregressive_decode computed before choosing tokens[at], in the
    model's dtype: its own forwards (the prompt, then one token at a time) replayed, so the row is
    the reference's, not a fresh prefill's, which sums in another order and rounds differently."""
    cache = lm.new_cache()
    feed = list(prompt_ids)
    for token in tokens[:at]:
        lm.forward(feed, cache, last_only=True)
        feed = [token]
    return lm.forward(feed, cache, last_only=True)[-1]


def top_two_logits(lm: LM, ids: Sequence[int]) -> tuple[float, float]:
    """The target's two largest next-token logits after `ids` (one fresh forward, untimed)."""
    top2 = torch.topk(lm.forward(list(ids), lm.new_cache(), last_only=True)[-1].float(), 2).values
    return float(top2[0]), float(top2[1])


def logit_gap(lm: LM, ids: Sequence[int]) -> float:
    """The target's top1 - top2 next-token logit gap after `ids`. Where an output departs from
    autoregressive greedy, ~0 (an ulp of the dtype) is a numerical near-tie, a clear gap a
    decoding error."""
    top1, top2 = top_two_logits(lm, ids)
    return top1 - top2


class NoDraft:
    """The proposer of autoregressive decoding in the batched loop: the root alone, every step."""

    def propose(self, sequence, room) -> Proposal:
        return Proposal(TokenTree.chain(sequence[-1], []))

    def commit(self, proposal, scores, path, sequence) -> dict:
        return {}


@dataclass
class Autoregressive:
    name: str = "autoregressive"
    lossless: bool = True

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        return autoregressive_decode(lm, prompt_ids, max_new_tokens, sampling, stop_ids)

    def proposer(self, lm: LM, prompt_ids, sampler, stop_ids):
        """Batched (gen.batch_size > 1): the shared loop with nothing drafted. One prompt alone keeps
        autoregressive_decode, the leanest loop, as every ratio's baseline."""
        return NoDraft(), None
