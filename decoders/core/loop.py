"""The one loop every draft-and-verify method runs: propose -> verify -> commit.

Each step, a proposer (decoders/methods/) builds a token tree after the last committed token,
its root. One target forward scores the committed tokens not yet cached, an optional side
branch and the tree; verification (verify.py) picks the accepted path and the target's own
next token after it (the bonus); the step commits them, the proposer updates its state, and
the target's cache keeps the committed tokens only. The split follows vLLM's proposer /
scorer / rejection sampler; the loop follows gpt-fast's speculative_decode.

A proposer may propose nothing at the first step (the prefill): its tree is then the root
alone, and the step is an autoregressive one over the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from .kv_cache import KVCache
from .lm import LM
from .sampling import Sampler
from .trace import Generation, Tracer, truncate_at_stop
from .tree import TokenTree
from .verify import verify_greedy, verify_sampling


@dataclass
class SideBranch:
    """Tokens the target scores beside the tree without verifying them (lookahead's Jacobi
    window). They see every committed token and each other as `mask` says, never the tree."""

    tokens: list[int]
    mask: torch.Tensor  # (s, s) bool: which side tokens each side token sees (itself included)
    offsets: torch.Tensor  # (s,) positions after the root
    rows: list[int]  # side tokens whose logits the proposer wants back, in this order


@dataclass
class Proposal:
    tree: TokenTree  # node 0 is the root: the last committed token
    # Sampling verification: row c is the distribution node c's token was drawn from (the root's row
    # is never read); None for deterministic candidates (n-gram guesses, heads' top-k).
    draft_probs: torch.Tensor | None = None
    draws: list[list[int]] | None = None  # per node, its children in draw order, duplicates kept (SpecInfer)
    without_replacement: bool = False  # siblings were drawn without replacement (Sequoia)
    side: SideBranch | None = None
    hidden: bool = False  # return the target's last hidden state for each tree node (heads read it)
    features: bool | tuple[int, ...] = False  # the target's features (LM.forward's `features`) for every row but the side branch
    draft_forward_tokens: int = 0  # tokens fed to a draft model or heads for this proposal
    draft_flops: float = 0.0
    draft_prefill_flops: float = 0.0  # of draft_flops, the draft's own pass over the prompt


@dataclass
class Scores:
    """The target's forward over a proposal."""

    logits: torch.Tensor  # (len(tree), V): after each tree node
    side_logits: torch.Tensor | None = None  # (len(side.rows), V)
    hidden: torch.Tensor | None = None  # (len(tree), d) when the proposal asked for it
    # (uncached + len(tree) - 1, d) when asked for: the uncached committed tokens (the root last), then the
    # tree after the root, so tree node i is row uncached - 1 + i
    features: torch.Tensor | None = None


class Proposer(Protocol):
    """One generation's drafting state (built per prompt by its method)."""

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        """A tree rooted at sequence[-1] (the committed tokens so far). `room`: drafts beyond this
        many can never be committed (max_new_tokens)."""

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        """After verification: `path` is the accepted node indices from the root, `sequence` the
        committed tokens including this step's. Update drafting state; return the step's info."""


Accept = Callable[[TokenTree, torch.Tensor, Sampler], tuple[list[int], int]]  # (tree, logits, sampler) -> path, bonus


def verify(proposal: Proposal, logits: torch.Tensor, sampler: Sampler) -> tuple[list[int], int]:
    """Exact verification: greedy matching, or speculative sampling that keeps the target's distribution."""
    if sampler.greedy:
        return verify_greedy(proposal.tree, logits)
    return verify_sampling(proposal.tree, sampler.probs(logits), proposal.draft_probs, sampler.generator,
                           without_replacement=proposal.without_replacement, draws=proposal.draws)


def layout(cache_len: int, uncached: int, tree: TokenTree, side: SideBranch | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (q, cache_len + q) and positions for [the `uncached` committed tokens (the root last),
    side branch, tree nodes after the root]. Both branches see every committed token; a tree node
    sees its own ancestors, a side token what side.mask allows; neither branch sees the other."""
    c, u, n = cache_len, uncached, len(tree)
    s = len(side.tokens) if side is not None else 0
    q = u + s + n - 1
    mask = torch.zeros(q, c + q, dtype=torch.bool)
    mask[:, :c] = True
    mask[:u, c:c + u] = torch.tril(torch.ones(u, u, dtype=torch.bool))
    mask[u:, c:c + u] = True
    mask[u + s:, c + u + s:] = tree.ancestor_mask()[1:, 1:]
    root = c + u - 1
    positions = [torch.arange(c, c + u)]
    if side is not None:
        mask[u:u + s, c + u:c + u + s] = side.mask
        positions.append(root + side.offsets)
    positions.append(root + torch.tensor(tree.depths[1:], dtype=torch.long))
    return mask, torch.cat(positions)


def score(lm: LM, cache: KVCache, uncached: Sequence[int], proposal: Proposal) -> Scores:
    """One target forward over [committed tokens not yet cached (the root last), side branch, tree
    nodes after the root], laid out by layout(). A chain without side branch is fed causally."""
    tree, side = proposal.tree, proposal.side
    if uncached[-1] != tree.tokens[0]:
        raise ValueError("the proposal's root must be the last committed token")
    u, n = len(uncached), len(tree)
    side_tokens = side.tokens if side is not None else []
    kwargs = {}
    if side is not None or not tree.is_chain():
        kwargs["mask"], kwargs["position_ids"] = layout(len(cache), u, tree, side)
    if side is None:
        kwargs["logits_last"] = n  # the tree's rows are the last n
    else:  # the root, the side rows asked for, the tree after the root
        s = len(side_tokens)
        kwargs["logits_rows"] = [u - 1, *(u + r for r in side.rows), *range(u + s, u + s + n - 1)]
    out = lm.forward(list(uncached) + side_tokens + tree.tokens[1:], cache, hidden=proposal.hidden,
                     features=proposal.features, **kwargs)
    logits, extra = out if proposal.hidden or proposal.features else (out, None)
    hidden = extra if proposal.hidden else None
    features = extra if proposal.features else None
    if side is None:
        return Scores(logits, None, hidden, features)
    k, s = len(side.rows), len(side_tokens)

    def tree_rows(x):
        return torch.cat([x[:1], x[1 + k:]])
    return Scores(tree_rows(logits), logits[1:1 + k], tree_rows(hidden) if hidden is not None else None,
                  torch.cat([features[:u], features[u + s:]]) if features is not None else None)


def speculative_decode(lm: LM, proposer: Proposer, prompt_ids: Sequence[int], max_new_tokens: int,
                       sampler: Sampler, stop_ids, accept: Accept | None = None) -> Generation:
    """Decode with `proposer`'s drafts, one target forward per step. `accept` replaces exact
    verification (Medusa's typical acceptance: lossy)."""
    tracer = Tracer(lm.sync)
    cache = lm.new_cache()
    sequence = list(prompt_ids)  # every committed token: the prompt, then the new ones
    tokens: list[int] = []
    while True:
        context = len(cache)
        uncached = sequence[context:]  # the prompt at the first step, then the last step's bonus token
        with tracer.draft():
            proposal = proposer.propose(sequence, max_new_tokens - len(tokens) - 1)
        tree, side = proposal.tree, proposal.side
        with tracer.target():
            scores = score(lm, cache, uncached, proposal)
        path, bonus = accept(tree, scores.logits, sampler) if accept is not None else verify(proposal, scores.logits, sampler)
        new = truncate_at_stop([tree.tokens[i] for i in path[1:]] + [bonus], stop_ids, max_new_tokens - len(tokens))
        tokens += new
        sequence += new
        with tracer.draft():
            info = proposer.commit(proposal, scores, path, sequence)
        s = len(side.tokens) if side is not None else 0
        tracer.end_step(accepted=len(new), forward_tokens=len(uncached) - 1 + s + len(tree), context_tokens=context,
                        draft_tokens=len(tree) - 1, accepted_draft_tokens=min(len(path) - 1, len(new)),
                        draft_forward_tokens=proposal.draft_forward_tokens, draft_flops=proposal.draft_flops,
                        draft_prefill_flops=proposal.draft_prefill_flops, info=info)
        if tokens[-1] in stop_ids or len(tokens) >= max_new_tokens:
            return tracer.finish(tokens, stop_ids)
        # Keep the committed tokens through the root, then the accepted nodes (after the side branch).
        root = context + len(uncached) - 1
        cache.keep(list(range(root + 1)) + [root + s + i for i in path[1:]])
