"""Growing a token tree with a draft model, and keeping the draft's KV cache in step.

The tree's shape is given (parents in level order, a node's children in the order they are
drawn). The draft runs one forward per level, feeding that level's inner nodes together under
a mask (the committed context + each node's own ancestors), so a tree of depth d costs d
draft forwards whatever its width.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..core import transfer
from ..core.kv_cache import KVCache, level_mask
from ..core.lm import LM, forward_flops
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler
from ..core.tree import TokenTree, ancestors, depths_of


@dataclass
class DraftTree:
    tokens: list  # node 0 = the root (last committed token); greedy on a GPU the rest are 0-d tensors there, unread
    parents: list[int]
    dists: list[torch.Tensor | None]  # per node: the draft distribution its token was drawn from (None: root / greedy)
    cache_index: dict[int, int]  # node -> its position in the draft cache (inner nodes only: leaves are never fed)
    forward_tokens: int  # tokens fed to the draft
    flops: float


def children_of(parents: Sequence[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    return kids


@dataclass(frozen=True)
class TreePlan:
    """What feeding a tree shape to the draft does at each level when every node is drawn, worked out
    once per shape (as EAGLE's static_plan): the inner nodes fed, and their masks and depths, already
    on the draft's device, so the depth loop copies nothing from the host."""

    levels: tuple[tuple[int, ...], ...]  # per level: the nodes fed (those with children), level order
    tails: tuple[torch.Tensor, ...]  # per level (F, fed before + F) bool over the tree rows fed: ancestors, itself
    depths: tuple[torch.Tensor, ...]  # per level (F,) long: each node's depth below the root


@functools.lru_cache(maxsize=64)
def tree_plan(parents: tuple[int, ...], device: torch.device) -> TreePlan:
    kids, depth = children_of(parents), depths_of(parents)
    slot: dict[int, int] = {}  # fed node -> its row among the tree rows fed
    levels, tails, depths, frontier = [], [], [], [0]
    while True:
        level = [c for n in frontier for c in kids[n] if kids[c]]
        if not level:
            break
        fed = len(slot)
        tails.append(level_mask(fed, 0, [[slot[a] for a in ancestors(parents, n)] for n in level]).to(device))
        depths.append(torch.tensor([depth[n] for n in level], device=device))
        slot.update((n, fed + r) for r, n in enumerate(level))
        levels.append(tuple(level))
        frontier = level
    return TreePlan(tuple(levels), tuple(tails), tuple(depths))


def _sample(logits: torch.Tensor, n: int, sampler: Sampler, replacement: bool):
    """n child tokens drawn from one draft distribution, with or without replacement. Returns the
    tokens (possibly fewer, when the distribution has fewer than n tokens left to draw) and the
    distribution."""
    if n == 0:  # e.g. Sequoia's tree for an all-zero acceptance vector is the root alone
        return [], None
    q = sampler.probs(logits[None])[0]
    if not replacement:
        n = min(n, int((q > 0).sum()))
    return torch.multinomial(q, n, replacement=replacement, generator=sampler.generator).tolist(), q


def _draw_level(rows: torch.Tensor, counts: Sequence[int], sampler: Sampler, replacement: bool) -> list[tuple]:
    """counts[f] child tokens from each row of (F, V) `rows`, the draft's logits after a node, and the
    distribution they were drawn from (None: greedy, the top counts[f] in order). Greedy takes every
    row's top tokens with one top-k over the level; on a GPU they stay there as 0-d tensors (feeding
    the next level, and read with verification, tree.drafted_tree: each read made the host wait), on a
    CPU ints."""
    if not sampler.greedy:
        return [_sample(row, n, sampler, replacement) for row, n in zip(rows, counts)]
    k = min(max(counts), rows.shape[-1])
    if not k:
        return [([], None) for _ in counts]
    top = torch.topk(rows, k).indices  # (F, k)
    if not transfer.reads_wait(rows.device):
        top = top.tolist()
    return [(top[f][:n], None) for f, n in enumerate(counts)]


def _as_input(tokens: list):
    """A level's tokens as the draft's input: the ints, or the device's 0-d tensors stacked there."""
    return torch.stack(tokens) if isinstance(tokens[0], torch.Tensor) else tokens


def draft_tree(draft: LM, cache: KVCache, sequence: Sequence[int], parents: Sequence[int], sampler: Sampler, *,
               replacement: bool = False) -> DraftTree:
    """Fill the shape `parents` (level order) with draft tokens after the committed `sequence`
    (whose last token is the root). Children are drawn without replacement (Sequoia) or
    independently with replacement (SpecInfer's independent sequences)."""
    spec = draft.flops_spec()
    kids = children_of(parents)
    root_pos = len(sequence) - 1
    tokens: list[int] = [int(sequence[-1])] + [-1] * (len(parents) - 1)
    dists: list[torch.Tensor | None] = [None] * len(parents)
    depth = depths_of(tuple(parents))
    alive = [True] * len(parents)  # False: its token could not be drawn; it drops with its subtree
    # Catch up on the committed tokens the draft has not seen; its last row is the root's.
    context = len(cache)
    feed = list(sequence[context:])
    logits = draft.forward(feed, cache, last_only=True)
    forward_tokens, flops = len(feed), forward_flops(spec, len(feed), context)
    cache_index = {0: len(cache) - 1}
    frontier, rows = [0], logits[-1:]  # nodes to expand; (F, V) the draft's logits after each
    plan, planned, fed_levels = tree_plan(tuple(parents), draft.device), True, 0
    while frontier:
        level: list[int] = []  # nodes drawn this round that have children of their own
        for node, (drawn, q) in zip(frontier, _draw_level(rows, [len(kids[n]) for n in frontier], sampler,
                                                          replacement)):
            children = kids[node]
            for child, token in zip(children, drawn):
                tokens[child], dists[child] = token, q  # an int, or a 0-d tensor still on the device
                if kids[child]:
                    level.append(child)
            for child in children[len(drawn):]:
                alive[child] = False
        if not level:
            break
        # One forward for the level: each node sees the context and its own fed ancestors.
        base = len(cache)
        # The plan holds while every node so far was drawn (a node not drawn takes its subtree with it,
        # and the rows fed after it move)
        planned = planned and tuple(level) == plan.levels[fed_levels]
        if planned:  # the plan's tensors, already on the device
            tail = plan.tails[fed_levels]  # (F, tree rows fed + F)
            mask = torch.cat([tail.new_ones(len(level), root_pos + 1), tail], 1)
            positions = plan.depths[fed_levels] + root_pos
        else:  # sampling without replacement ran out of tokens: this level's mask, from the host
            mask = level_mask(base, root_pos + 1, [[cache_index[a] for a in ancestors(parents, n)] for n in level])
            positions = [root_pos + depth[n] for n in level]
        out = draft.forward(_as_input([tokens[n] for n in level]), cache, position_ids=positions, mask=mask)
        forward_tokens, flops = forward_tokens + len(level), flops + forward_flops(spec, len(level), base)
        for r, node in enumerate(level):
            cache_index[node] = base + r
        frontier, rows, fed_levels = level, out, fed_levels + 1
    # Drop nodes that could not be drawn (sampling without replacement from a distribution
    # with fewer tokens than children): renumber the survivors, keeping level order.
    kept = [True] * len(parents)
    for i in range(1, len(parents)):  # level order: a parent's fate is known before its children's
        kept[i] = alive[i] and kept[parents[i]]
    keep = [i for i in range(len(parents)) if kept[i]]
    new = {old: j for j, old in enumerate(keep)}
    return DraftTree(tokens=[tokens[i] for i in keep], parents=[-1] + [new[parents[i]] for i in keep[1:]],
                     dists=[dists[i] for i in keep],
                     cache_index={new[i]: c for i, c in cache_index.items() if i in new}, forward_tokens=forward_tokens,
                     flops=flops)


def rollback(cache: KVCache, committed_len: int, tree: DraftTree, path_nodes: Sequence[int]) -> None:
    """Keep the draft cache's committed context (through the root) plus the accepted path's fed
    nodes, so it holds exactly a prefix of the new committed sequence."""
    fed_path = []
    for node in path_nodes[1:]:
        if node not in tree.cache_index:
            break  # a leaf: never fed; nothing below it is either
        fed_path.append(tree.cache_index[node])
    cache.keep(list(range(committed_len)) + fed_path)


# grow(draft, draft cache, committed sequence) -> (the tree the target verifies, draft_probs rows per
# tree node or None, tree node -> draft node, the DraftTree, draws for verify_sampling or None)
Grow = Callable[[LM, KVCache, Sequence[int]],
                tuple[TokenTree, "torch.Tensor | None", list[int], DraftTree, "list | None"]]


class DraftTreeProposer:
    """The proposer SpecInfer and Sequoia share: `grow` drafts a tree with the draft model, whose
    cache then keeps the committed tokens and the accepted path's fed nodes."""

    waits_for_prefill = True  # the draft starts on the target's first token
    hidden, feature_layers = False, False  # it reads nothing of the target's pass

    def __init__(self, draft: LM, prompt_len: int, grow: Grow, without_replacement: bool):
        self.draft, self.prompt_len, self.grow, self.without_replacement = draft, prompt_len, grow, without_replacement
        self.cache = draft.new_cache()
        # This step's drafted tree for commit(); before the first proposal (the prefill) the root alone,
        # nothing fed, so the first rollback keeps the empty cache as it is.
        self.dtree: DraftTree | None = None
        self.to_draft: list[int] = [0]  # tree node -> draft node
        self.committed = 0  # committed tokens when the tree was drafted

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        first = not len(self.cache)  # the draft's first catch-up reads the prompt: its prefill
        tree, draft_probs, self.to_draft, self.dtree, draws = self.grow(self.draft, self.cache, sequence)
        self.committed = len(sequence)
        fed_to_draft = self.dtree.forward_tokens
        prefill = forward_flops(self.draft.flops_spec(), self.prompt_len, 0) if first and fed_to_draft else 0.0
        return Proposal(tree, draft_probs=draft_probs, draws=draws, without_replacement=self.without_replacement,
                        draft_forward_tokens=fed_to_draft, draft_flops=self.dtree.flops, draft_prefill_flops=prefill)

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        rollback(self.cache, self.committed, self.dtree, [self.to_draft[i] for i in path])
        tree = proposal.tree
        return {"draft_depth": max(tree.depths), "accepted_depth": len(path) - 1, "tree_size": len(tree)}


def stacked_dists(dists: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Rows for verify_sampling: the root's (never read) and greedy's are zeros; None if none was sampled."""
    if all(d is None for d in dists):
        return None
    ref = next(d for d in dists if d is not None)
    return torch.stack([d if d is not None else torch.zeros_like(ref) for d in dists])
