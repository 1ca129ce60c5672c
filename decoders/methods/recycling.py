"""Token Recycling (Luo et al. 2024): training-free drafts from candidates the target itself
ranked and then discarded.

An adjacency table keeps, for every token seen, the `successors` tokens the target ranked
highest after it the last time it scored that token (any row of any target pass: committed
tokens and rejected drafts alike, so nothing the target computed is thrown away). Each step a
static tree of rank paths is filled from the table: the root is the last committed token, and a
node's rank-r child is the rank-r successor of the node's token. The tree is verified in one
target pass; candidates are deterministic, so greedy is exact and sampling uses
deterministic-candidate acceptance (the target's distribution is kept).

`hot_start` (the paper's default) keeps the table from one prompt to the next, so a prompt's
drafts depend on the prompts decoded before it with the same decoder (in dataset order in the
runner and leaderboard); hot_start=false starts every prompt empty. The prompt's own rows are not
scored (the prefill keeps only its last row's logits), so its tokens get successors once seen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


from ..core.contract import PerTarget, check, check_step, decode_one
from ..core.lm import LM
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler
from ..core.tree import TokenTree, best_paths, prior_accuracy, rank_tree


class AdjacencyDraft:
    """The proposer: the template tree (parents, and per node after the root the rank of its
    token among its parent's successors) filled from the adjacency table."""

    waits_for_prefill = False  # a hot table drafts at the prefill too

    def __init__(self, parents: Sequence[int], ranks: Sequence[int], successors: int,
                 table: dict[int, list[int]] | None = None):
        self.parents, self.ranks, self.k = list(parents), list(ranks), successors
        self.table = {} if table is None else table  # token -> the target's top-k next tokens after it

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        tokens, parents = [int(sequence[-1])], [-1]
        placed = {0: 0}  # template node -> tree node (a node whose parent has no such successor drops)
        for node in range(1, len(self.parents)):
            parent = placed.get(self.parents[node])
            following = self.table.get(tokens[parent]) if parent is not None else None
            if following is not None and self.ranks[node - 1] < len(following):
                placed[node] = len(tokens)
                tokens.append(following[self.ranks[node - 1]])
                parents.append(parent)
        return Proposal(TokenTree(tokens, parents), top_k=self.k)

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        for token, following in zip(proposal.tree.tokens, scores.top()):  # each tree row's top-k successors
            self.table[token] = following
        tree = proposal.tree
        return {"draft_depth": max(tree.depths), "accepted_depth": len(path) - 1, "tree_size": len(tree)}


def template(tree_size: int, depth: int, successors: int) -> tuple[list[int], list[int]]:
    """The static tree: the `tree_size` rank paths of depth <= `depth` most likely under a prior
    that halves with each rank (Medusa's prior), as (parents, rank of each node after the root)."""
    paths = best_paths(prior_accuracy(depth, successors), tree_size, successors)
    parents, slots = rank_tree(paths)
    return parents, [rank for _, rank in slots]


@dataclass
class Recycling:
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    tree_size: int = 30  # draft nodes in the static tree (verification width - 1)
    depth: int = 6  # its deepest level
    successors: int = 8  # tokens kept per token in the adjacency table (the most ranks a node's children use)
    hot_start: bool = True  # keep the table from prompt to prompt (the paper's default)

    def __post_init__(self):
        for key in ("tree_size", "depth", "successors"):
            check(key, getattr(self, key), at_least=1)
        check("hot_start", self.hot_start, one_of=(True, False))
        self.widest_step = check_step(1 + self.tree_size, f"1 + tree_size {self.tree_size}")
        self._tables: PerTarget[dict] = PerTarget()  # per target, the table carried between its prompts

    def carried(self, lm: LM) -> dict:
        """The hot table carried between lm's prompts (CarriesState); empty without hot_start."""
        return self._tables.get(lm, dict) if self.hot_start else {}

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        """Rows of one batch share the hot table (each commits into it in turn): lossless, but their
        drafts then differ from one prompt at a time."""
        table = self.carried(lm) if self.hot_start else None  # a new target starts empty
        parents, ranks = template(self.tree_size, self.depth, self.successors)
        return AdjacencyDraft(parents, ranks, self.successors, table), None

    generate = decode_one  # one prompt through the shared loop
