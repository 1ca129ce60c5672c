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

from ..core.contract import PerTarget, check, check_step, decode_one
from ..core import transfer
from ..core.kv_cache import KVCache
from ..core.lm import LM, forward_flops
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler, argmax
from ..core.tree import TokenTree, drafted_tree
from .draft_model import DRAFT_REQUIRED, build_draft, draft_needs


def catch_up(draft: LM, cache: KVCache, sequence: Sequence[int]) -> tuple[torch.Tensor, int]:
    """Feed the draft every committed token it has not seen; return its logits after the last
    one and how many tokens that forward took."""
    feed = list(sequence[len(cache):])
    if not feed:
        raise ValueError("the draft cache already holds the last committed token")
    return draft.forward(feed, cache, last_only=True)[-1], len(feed)


def draft_chain(draft: LM, cache: KVCache, sequence: Sequence[int], k: int,
                sampler: Sampler) -> tuple[list, list[torch.Tensor], int, float]:
    """k draft tokens after `sequence`, each drawn from the draft (argmax when greedy).
    Returns the tokens, the distributions they were drawn from (sampling only), the tokens
    fed to the draft and its FLOPs. On a GPU each token stays there, a (1,) tensor, and feeds the
    next forward; nothing is read (per token, each read made the host wait): tree.drafted_tree
    reads them with verification, or tree.host_tokens at once."""
    spec = draft.flops_spec()
    tokens: list = []  # ints on a CPU; (1,) tensors on the draft's device elsewhere
    dists: list[torch.Tensor] = []
    forward_tokens, flops = 0, 0.0
    context = len(cache)
    logits, n = catch_up(draft, cache, sequence)
    on_host = not transfer.reads_wait(logits.device)
    forward_tokens, flops = n, forward_flops(spec, n, context)
    for i in range(k):
        if i:
            context = len(cache)
            logits = draft.forward([tokens[-1]] if on_host else tokens[-1], cache, last_only=True)[-1]
            forward_tokens, flops = forward_tokens + 1, flops + forward_flops(spec, 1, context)
        if sampler.greedy:
            tokens.append(argmax(logits) if on_host else torch.argmax(logits, -1, keepdim=True))
        else:
            q = sampler.probs(logits[None])[0]
            dists.append(q)
            drawn = torch.multinomial(q, 1, generator=sampler.generator)  # (1,)
            tokens.append(int(drawn) if on_host else drawn)
    return tokens, dists, forward_tokens, flops


class DraftChain:
    """The proposer: `depth` tokens drawn one at a time by the draft, which keeps its own cache of
    the committed tokens (plus the drafts it fed) and is cut back to them after each step. Never
    drafts past max_new_tokens."""

    waits_for_prefill = True  # the draft starts on the target's first token
    hidden, feature_layers = False, False  # it reads nothing of the target's pass

    def __init__(self, draft: LM, depth: int, prompt_len: int, sampler: Sampler):
        self.draft, self.depth, self.prompt_len, self.sampler = draft, depth, prompt_len, sampler
        self.cache = draft.new_cache()
        self.n_draft, self.committed = 0, 0  # this step's draft length and committed tokens, for commit()

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        self.n_draft = n = min(self.depth, room)
        self.committed = len(sequence)
        if not n:
            return Proposal(TokenTree.chain(sequence[-1], []))
        # The draft's first catch-up reads the prompt: its prefill, left out of decode FLOPs.
        prefill = forward_flops(self.draft.flops_spec(), self.prompt_len, 0) if not len(self.cache) else 0.0
        s = self.sampler
        drafts, dists, forward_tokens, flops = draft_chain(self.draft, self.cache, sequence, n, s)
        draft_probs = torch.stack([torch.zeros_like(dists[0]), *dists]) if dists else None
        return Proposal(drafted_tree(int(sequence[-1]), drafts, range(-1, n)), draft_probs=draft_probs,
                        draft_forward_tokens=forward_tokens, draft_flops=flops, draft_prefill_flops=prefill)

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        if self.n_draft:  # the draft saw the committed tokens and drafts[:-1]
            self.cache.crop(self.committed + min(len(path) - 1, self.n_draft - 1))
        return {"draft_depth": self.n_draft, "accepted_depth": len(path) - 1}


@dataclass
class SpecChain:
    """decoder=spec_chain: draft `depth` tokens with `draft`, verify them in one target pass."""

    draft: Any = None  # draft=self (decoders.methods.draft_model.SelfDraft) or a model config
    depth: int = 4  # draft tokens per step: the chain's depth
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    _drafts: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)

    target_needs = property(lambda self: draft_needs(self.draft))  # contract.check_engine

    def __post_init__(self):
        check("depth", self.depth, at_least=1)
        self.widest_step = check_step(1 + self.depth, f"1 + depth {self.depth}")
        check("draft", self.draft, required=DRAFT_REQUIRED)

    def load_addons(self, lm: LM) -> LM:
        """The draft for target `lm`, built once (the runner calls this before timing)."""
        return self._drafts.get(lm, lambda: build_draft(self.draft, lm))

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        return DraftChain(self.load_addons(lm), self.depth, len(prompt_ids), sampler), None

    generate = decode_one  # one prompt through the shared loop
