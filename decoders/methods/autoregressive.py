"""Autoregressive decoding: one token per target forward, KV-cached. The baseline every ratio uses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..core.lm import LM
from ..core.loop import Proposal
from ..core.tree import TokenTree
from ..core.sampling import NonFiniteLogits, Sampling, next_token
from ..core.trace import Generation, new_tracer


def autoregressive_decode(lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                          stop_ids) -> Generation:
    tracer = new_tracer(lm.sync, lm.timing_event)
    cache = lm.new_cache(reserve=len(prompt_ids) + max_new_tokens)
    warpers = sampling.warpers()
    generator = sampling.generator(lm.output_device)
    tokens: list[int] = []
    feed = list(prompt_ids)
    while True:
        context = len(cache)
        with tracer.target():
            rows = lm.forward(feed, cache, last_only=True)
            maxima = lm.maxima_of(rows)
            logits = rows[-1]
        try:
            token = next_token(logits, sampling, generator, warpers, maxima[-1] if maxima is not None else None)
        except NonFiniteLogits as e:  # the reference's own step: named, so a run says where it broke
            raise NonFiniteLogits(e.value, step=len(tokens)) from None
        tokens.append(token)
        tracer.end_step(committed=1, forward_tokens=len(feed), context_tokens=context)
        if token in stop_ids or len(tokens) >= max_new_tokens:
            return tracer.finish(tokens, stop_ids)
        feed = [token]


def step_logits(lm: LM, prompt_ids: Sequence[int], tokens: Sequence[int]) -> Iterator[torch.Tensor]:
    """The target's next-token logits before each of `tokens`, in the model's dtype, from
    autoregressive_decode's own forwards (the prompt, then one token at a time) along `tokens`:
    on autoregressive's output they are its logits, replayed bitwise (a fresh prefill would sum
    in another order and round differently). Lazy: stop reading when done."""
    cache = lm.new_cache()
    feed = list(prompt_ids)
    for token in tokens:
        yield lm.forward(feed, cache, last_only=True)[-1]
        feed = [token]


def referee_logits(lm: LM, prompt_ids: Sequence[int], tokens: Sequence[int]) -> Callable[[int], torch.Tensor | None]:
    """The lossless check's referee along `tokens`: referee(i) is the target's next-token logits
    before tokens[i] from a copy of its weights in a wider dtype (LM.widened), one forward over the
    prompt and tokens[:i] (on llama.cpp, (m, V): m computations at the run's precision). The copy is
    made at the first call and dropped with the function; None where it does not fit in memory."""
    held: list[torch.nn.Module | None] = []

    def referee(i: int) -> torch.Tensor | None:
        if not held:
            held.append(lm.widened())
        if held[0] is None:
            return None
        ids = torch.tensor([[*prompt_ids, *tokens[:i]]], device=lm.device)
        return held[0](input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]

    return referee


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

    waits_for_prefill = False

    def propose(self, sequence, room) -> Proposal:
        return Proposal(TokenTree.chain(sequence[-1], []))

    def commit(self, proposal, scores, path, sequence) -> dict:
        return {}


@dataclass
class Autoregressive:
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    widest_step = 1  # one token a step (contract.DeclaresStep)

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        return autoregressive_decode(lm, prompt_ids, max_new_tokens, sampling, stop_ids)

    def proposer(self, lm: LM, prompt_ids, sampler, stop_ids):
        """Batched (gen.batch_size > 1): the shared loop with nothing drafted. One prompt alone keeps
        autoregressive_decode, the leanest loop, as every ratio's baseline."""
        return NoDraft(), None
