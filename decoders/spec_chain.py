"""Speculative decoding with a draft model, chain of k (Leviathan et al. 2023; Chen et al. 2023).

Each step: the draft proposes k tokens one at a time (its own KV cache), the target scores
the last committed token plus the k drafts in one forward pass, and verification keeps the
longest accepted prefix plus one token of the target's own (greedy: argmax match; sampling:
accept x with min(1, p(x)/q(x)), else sample the residual norm(max(p - q, 0))). Both caches
are cropped back to the committed tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .draft import DraftCache
from .lm import LM, KVCache, forward_flops
from .sampling import Sampling, next_token, probs
from .trace import Generation, Tracer, truncate_at_stop
from .tree import TokenTree
from .verify import verify_greedy, verify_sampling


def catch_up(draft: LM, cache: KVCache, sequence: Sequence[int]) -> tuple[torch.Tensor, int]:
    """Feed the draft every committed token it has not seen; return its logits after the last
    one and how many tokens that forward took."""
    feed = list(sequence[len(cache):])
    if not feed:
        raise ValueError("the draft cache already holds the last committed token")
    return draft.forward(feed, cache, last_only=True)[-1], len(feed)


def draft_chain(draft: LM, cache: KVCache, sequence: Sequence[int], k: int, sampling: Sampling, generator,
                warpers) -> tuple[list[int], list[torch.Tensor], int, float]:
    """k draft tokens after `sequence`, each drawn from the draft (argmax when greedy).
    Returns the tokens, the distributions they were drawn from (sampling only), the tokens
    fed to the draft and its FLOPs."""
    spec = draft.flops_spec()
    tokens: list[int] = []
    dists: list[torch.Tensor] = []
    fed, flops = 0, 0.0
    context = len(cache)
    logits, n = catch_up(draft, cache, sequence)
    fed, flops = n, forward_flops(spec, n, context)
    for i in range(k):
        if i:
            context = len(cache)
            logits = draft.forward([tokens[-1]], cache, last_only=True)[-1]
            fed, flops = fed + 1, flops + forward_flops(spec, 1, context)
        if sampling.greedy:
            tokens.append(int(torch.argmax(logits)))
        else:
            q = probs(logits[None], sampling, warpers)[0]
            dists.append(q)
            tokens.append(int(torch.multinomial(q, 1, generator=generator)))
    return tokens, dists, fed, flops


def spec_chain_decode(lm: LM, draft: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                      stop_ids, k: int) -> Generation:
    tracer = Tracer(lm.sync)
    cache, draft_cache = lm.new_cache(), draft.new_cache()
    warpers = sampling.warpers()
    generator = sampling.generator(lm.device)
    prompt = list(prompt_ids)

    with tracer.target():  # the prefill commits the first token
        logits = lm.forward(prompt, cache, last_only=True)[-1]
    tokens = [next_token(logits, sampling, generator, warpers)]
    tracer.end_step(accepted=1, forward_tokens=len(prompt), context_tokens=0)

    while tokens[-1] not in stop_ids and len(tokens) < max_new_tokens:
        sequence = prompt + tokens
        context = len(cache)
        # Never draft past max_new_tokens: a step commits at most n_draft + 1 tokens.
        n_draft = min(k, max_new_tokens - len(tokens) - 1)
        fed, flops, drafts, dists = 0, 0.0, [], []
        # The draft's first catch-up reads the prompt: its prefill, left out of decode FLOPs.
        prefill = forward_flops(draft.flops_spec(), len(prompt), 0) if n_draft and not len(draft_cache) else 0.0
        if n_draft:
            with tracer.draft():
                drafts, dists, fed, flops = draft_chain(draft, draft_cache, sequence, n_draft, sampling, generator, warpers)
        tree = TokenTree.chain(tokens[-1], drafts)
        with tracer.target():
            logits = lm.forward(tree.tokens, cache)
        if sampling.greedy:
            path, bonus = verify_greedy(tree, logits)
        else:
            draft_probs = torch.stack([torch.zeros_like(dists[0]), *dists]) if dists else None
            path, bonus = verify_sampling(tree, probs(logits, sampling, warpers), draft_probs, generator)
        accepted_drafts = len(path) - 1
        new = truncate_at_stop([tree.tokens[i] for i in path[1:]] + [bonus], stop_ids, max_new_tokens - len(tokens))
        tokens += new
        cache.crop(context + len(path))  # the root and the accepted drafts; the bonus is fed next step
        if n_draft:  # the draft saw the sequence and drafts[:-1]
            draft_cache.crop(len(sequence) + min(accepted_drafts, n_draft - 1))
        tracer.end_step(accepted=len(new), forward_tokens=len(tree), context_tokens=context, draft_tokens=n_draft,
                        accepted_draft_tokens=min(accepted_drafts, len(new)), draft_forward_tokens=fed,
                        draft_flops=flops, draft_prefill_flops=prefill, info={"draft_depth": n_draft, "accepted_depth": accepted_drafts})
    return tracer.finish(tokens, stop_ids)


@dataclass
class SpecChain:
    """decoder=spec_chain: draft `depth` tokens with `draft`, verify them in one target pass."""

    draft: Any = None  # draft=self (decoders.draft.SelfDraft) or a model config
    depth: int = 4  # draft tokens per step: the chain's depth
    name: str = "spec_chain"
    lossless: bool = True
    _drafts: DraftCache = field(default_factory=DraftCache, repr=False, compare=False)

    def __post_init__(self):
        if not (isinstance(self.depth, int) and self.depth >= 1):
            raise ValueError(f"decoder.depth (draft tokens per step) must be an integer >= 1, got {self.depth!r}")
        if self.draft is None:
            raise ValueError("decoder.draft is required: draft=self (the target's first layers) or draft=<model>")

    def load_draft(self, lm: LM) -> LM:
        """The draft for target `lm`, built once (the runner calls this before timing)."""
        return self._drafts.get(self.draft, lm)

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        return spec_chain_decode(lm, self.load_draft(lm), prompt_ids, max_new_tokens, sampling, stop_ids, self.depth)
