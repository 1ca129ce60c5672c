"""SpecInfer-style token trees (Miao et al. 2024), the baseline Sequoia is compared with:
k draft sequences of `depth` tokens, sampled independently from the draft, merged into a
trie and verified in one target pass (multi-step verification: the draws tried in draw order,
duplicates included, each accepted with min(1, p/q), the target's distribution replaced by the
residual after each rejection). Greedy: k independent greedy sequences would all be equal, so
the k sequences start from the draft's top-k first tokens and continue greedily.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.contract import PerTarget, check, check_step, decode_one
from ..core.lm import LM
from ..core.sampling import Sampler
from ..core.tree import TokenTree, host_tokens
from .draft_model import DRAFT_REQUIRED, build_draft, draft_needs
from .draft_tree import DraftTree, DraftTreeProposer, children_of, draft_tree, stacked_dists


def chains(k: int, depth: int) -> tuple[int, ...]:
    """Parents of k chains of `depth` nodes under one root, in level order."""
    parents = [-1] + [0] * k
    for level in range(1, depth):
        parents += [1 + (level - 1) * k + j for j in range(k)]
    return tuple(parents)


def merge_chains(dtree: DraftTree) -> tuple[TokenTree, torch.Tensor | None, list[int], list[list[int]]]:
    """The trie of the k drafted chains (dtree in the chains() layout), for the target to verify
    shared prefixes once. Returns (trie, draft_probs rows, trie node -> draft node, draws): draws
    holds, per trie node, the child each chain through it drew next, in draw order with
    duplicates kept, because multi-step verification must try every draw (verify_sampling)."""
    dtree.tokens = host_tokens(dtree.tokens)  # the trie merges equal tokens: read them now
    kids = children_of(dtree.parents)
    sequences, nodes = [], []  # each chain's tokens and draft nodes
    for first in kids[0]:
        chain = [first]
        while kids[chain[-1]]:
            chain.append(kids[chain[-1]][0])
        nodes.append(chain)
        sequences.append([dtree.tokens[n] for n in chain])
    tree = TokenTree.from_sequences(dtree.tokens[0], sequences)
    # Map each trie node to the first draft node that holds it (equal prefixes were drawn from
    # equal contexts, so any representative has the same distribution and cache entries).
    to_draft = [0] * len(tree)
    draws: list[list[int]] = [[] for _ in range(len(tree))]
    for chain in nodes:
        trie = 0
        for n in chain:
            child = next(c for c in tree.children[trie] if tree.tokens[c] == dtree.tokens[n])
            draws[trie].append(child)
            trie = child
            if to_draft[trie] == 0:
                to_draft[trie] = n
    dists = stacked_dists([dtree.dists[to_draft[i]] if i else None for i in range(len(tree))])
    return tree, dists, to_draft, draws


@dataclass
class SpecInfer:
    draft: Any = None  # draft=self or a model config
    num_drafts: int = 2  # independent draft sequences per step (SpecInfer's k)
    depth: int = 4  # draft tokens per sequence
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    _drafts: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)

    target_needs = property(lambda self: draft_needs(self.draft))  # contract.check_engine

    def __post_init__(self):
        check("num_drafts", self.num_drafts, at_least=1)
        check("depth", self.depth, at_least=1)
        self.widest_step = check_step(1 + self.num_drafts * self.depth,
                                      f"1 + num_drafts {self.num_drafts} x depth {self.depth}")
        check("draft", self.draft, required=DRAFT_REQUIRED)

    def load_addons(self, lm: LM) -> LM:
        return self._drafts.get(lm, lambda: build_draft(self.draft, lm))

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        parents = chains(self.num_drafts, self.depth)

        def grow(draft_lm, cache, sequence):
            dtree = draft_tree(draft_lm, cache, sequence, parents, sampler, replacement=True)
            tree, dists, to_draft, draws = merge_chains(dtree)
            return tree, dists, to_draft, dtree, draws

        return DraftTreeProposer(self.load_addons(lm), len(prompt_ids), grow, without_replacement=False), None

    generate = decode_one  # one prompt through the shared loop
