"""Autoregressive decoding: one token per target forward, KV-cached. The baseline every ratio uses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .lm import LM
from .sampling import Sampling, next_token
from .trace import Generation, Tracer


def autoregressive_decode(lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                          stop_ids, record_logit_gaps: bool = False) -> Generation:
    """record_logit_gaps: keep the target's top1 - top2 logit gap for every new token, so a
    lossless check can tell a numerical near-tie from a real divergence."""
    tracer = Tracer(lm.sync)
    cache = lm.new_cache()
    warpers = sampling.warpers()
    generator = sampling.generator(lm.device)
    tokens: list[int] = []
    gaps: list[float] | None = [] if record_logit_gaps else None
    feed = list(prompt_ids)
    while True:
        context = len(cache)
        with tracer.target():
            logits = lm.forward(feed, cache, last_only=True)[-1]
        token = next_token(logits, sampling, generator, warpers)
        if gaps is not None:
            top2 = torch.topk(logits.float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        tokens.append(token)
        tracer.end_step(accepted=1, forward_tokens=len(feed), context_tokens=context)
        if token in stop_ids or len(tokens) >= max_new_tokens:
            return tracer.finish(tokens, stop_ids, gaps)
        feed = [token]


@dataclass
class Autoregressive:
    name: str = "autoregressive"
    lossless: bool = True

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        return autoregressive_decode(lm, prompt_ids, max_new_tokens, sampling, stop_ids)
