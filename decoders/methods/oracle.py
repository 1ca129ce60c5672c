"""The oracle: drafts the target's own greedy continuation, each drafted token right with a chosen
probability, into a chosen tree shape. It needs no trained draft, so a device's speedup against
acceptance can be measured (and bench.forecast's replay checked against it) with the draft quality
a setting rather than a property of some add-on.

Where the truth comes from: the target's greedy continuation of the prompt, found by an
autoregressive pass (decoders/methods/autoregressive.py) before the prompt is timed: the runner
calls `foresee()` ahead of its clock (contract.Foresees), and the continuation is kept per target
and prompt, so `generate()` then only looks it up. A caller that did not foresee (a test, a script
calling generate()) has the pass made at the start of generate(): inside its wall time, before the
loop's first step, so still in no Step's time. The loop's own logits cannot stand in for it: the
token the target will choose at a depth is known only after the forward that verifies it.

What a step's time includes: the target's forward over the tree (as for any method), verification
and commit, and drafting as the trace's draft time: one uniform draw per first child and building
the TokenTree, microseconds. Not included: the pre-pass, nor any draft model, heads or feature
draft: a real drafter's cost is absent, so the oracle measures the verification side of a step
(the target's forward of the tree's width, and the loop's overhead) at a given acceptance.

The rule: the first child at each depth (rank 0 in the tree's rank paths; every node of a chain)
is the true next token with probability `acceptance`, independently per node, from a generator
seeded by `seed` and the prompt (so runs and repeats draw the same); else a wrong one, (true + 1)
mod V. Other children (rank r >= 1) are always wrong, (true + 1 + r) mod V, distinct from their
siblings, so a tree accepts what the chain of its first children would, at its own width's cost:
the expected tokens per step are 1 + sum_{i=1..D} p^i, D the depth of the first-child path (a node
under a wrong one is never reached by verification, whatever it holds). Like the draft-based
methods it waits for the prefill (the prompt's pass drafts nothing). Greedy only: under sampling
there is no single true token.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch

from ..core.contract import PerTarget, check, check_sampling, check_step, decode_one
from ..core.lm import LM
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler, Sampling
from ..core.tree import TokenTree, published_trees, rank_tree
from .autoregressive import autoregressive_decode


class Shape(NamedTuple):
    """A draft tree without tokens, root first, nodes sorted by depth: each node's parent, its rank
    among its siblings (0: the first child, the only one that may be right; the root's: -1), its depth."""

    parents: list[int]
    ranks: list[int]
    depths: list[int]


class OracleProposer:
    """One prompt's drafts: the shape's first `n` nodes (those within `room` and the known
    continuation), tokens from the continuation by the rule in the module's docstring."""

    waits_for_prefill = True  # the prefill is the prompt's autoregressive pass, as for draft-based methods
    hidden, feature_layers = False, False  # what the loop scores the prefill with: nothing extra

    def __init__(self, shape: Shape, acceptance: float, truth: list[int], prompt_len: int, vocab: int,
                 rng: random.Random):
        self.parents, self.ranks, self.depths = shape
        self.acceptance, self.truth, self.prompt_len, self.vocab, self.rng = acceptance, truth, prompt_len, vocab, rng
        self.checked = 0  # new tokens compared with the continuation so far
        self.off_reference = False  # the committed tokens left it (a near-tie rounded otherwise): no truth known

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        pos = len(sequence) - self.prompt_len  # new tokens committed so far: truth[pos] is the next one
        depth = max(0, min(room, len(self.truth) - pos))  # no draft past max_new_tokens or the known continuation
        n = next((i for i, d in enumerate(self.depths) if d > depth), len(self.depths))  # nodes sorted by depth
        tokens = [sequence[-1]]
        for i in range(1, n):
            true = self.truth[pos + self.depths[i] - 1]
            rank = self.ranks[i]
            right = rank == 0 and self.rng.random() < self.acceptance
            tokens.append(true if right else (true + 1 + rank) % self.vocab)
        return Proposal(TokenTree(tokens, self.parents[:n]))

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        end = len(sequence) - self.prompt_len
        if not self.off_reference and list(sequence[self.prompt_len + self.checked:]) != self.truth[self.checked:end]:
            self.off_reference = True  # from here on the drafts still come from the continuation, a wrong one
        self.checked = end
        return {"off_reference": True} if self.off_reference else {}


def tree_shape(tree: Any, depth: int) -> Shape:
    """`tree` cut to `depth`: a chain of `depth` nodes, or a published tree's rank paths of at most
    `depth` tokens (rank_tree's order: by depth)."""
    if tree == "chain":
        return Shape(list(range(-1, depth)), [-1] + [0] * depth, list(range(depth + 1)))
    method, _, name = str(tree).partition("/")
    paths = published_trees().get(method, {}).get(name)
    if paths is None:
        named = [f"{m}/{n}" for m, trees in published_trees().items() for n in trees]
        raise ValueError(f"decoder.tree must be chain or a published tree ({', '.join(named)}; "
                         f"decoders/published_trees.json), got {tree!r}")
    ranked = rank_tree([p for p in paths if len(p) <= depth], "tree")
    return Shape(ranked.parents, [-1] + [rank for _, rank in ranked.slots], [0] + [d + 1 for d, _ in ranked.slots])


@dataclass
class Oracle:
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True  # the loop verifies every drafted token
    acceptance: float = 0.5  # probability that a first child is the true next token
    depth: int = 4  # chain: drafted tokens per step; a published tree: cut to its paths of at most this many
    tree: str = "chain"  # chain | eagle/mc_sim_7b_63 | medusa/mc_sim_7b_63 (decoders/published_trees.json)
    seed: int = 0  # with the prompt's tokens, seeds each prompt's draws
    # per target: prompt ids and stop ids -> the target's greedy continuation (foresee())
    _truth: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)

    greedy_only = True  # not a field: runner.check_config refuses gen.temperature > 0 (contract.check_sampling)

    def __post_init__(self):
        a = self.acceptance
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"decoder.acceptance must be a number from 0 to 1, got {a!r}")
        check("depth", self.depth, at_least=1)
        check("seed", self.seed, at_least=0)
        self.shape = tree_shape(self.tree, self.depth)
        self.widest_step = check_step(len(self.shape.parents), f"tree {self.tree} at depth {self.depth}: 1 + drafts")
        first = [0]  # the path of first children from the root: all that can be accepted
        for i, (parent, rank) in enumerate(zip(self.shape.parents, self.shape.ranks)):
            if rank == 0 and parent == first[-1]:
                first.append(i)
        spine = len(first) - 1
        self.tuning = {"oracle_acceptance": float(a), "tree": self.tree, "depth": max(self.shape.depths),
                       "draft_nodes": len(self.shape.parents) - 1,
                       "expected_tokens": 1 + sum(a ** i for i in range(1, spine + 1)),  # per step, bonus included
                       "continuation": "the target's greedy output, from an autoregressive pass before the "
                                       "prompt's clock: in no timed figure"}

    def foresee(self, lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids) -> None:
        """The target's greedy continuation of `prompt_ids`, kept for generate(); a kept one that is
        long enough (or ends at a stop token) is reused."""
        known = self._truth.get(lm, dict)
        key = (tuple(prompt_ids), frozenset(stop_ids))
        tokens = known.get(key)
        if tokens is not None and (len(tokens) >= max_new_tokens or tokens[-1] in stop_ids):
            return
        with torch.inference_mode():
            known[key] = autoregressive_decode(lm, prompt_ids, max_new_tokens, Sampling(), stop_ids).tokens

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        check_sampling(self, sampler.sampling)
        truth = self._truth.get(lm, dict).get((tuple(prompt_ids), frozenset(stop_ids)))
        if truth is None:
            raise ValueError(f"decoder {self.name}: no continuation foreseen for this prompt: call foresee() "
                             "before decoding it (the runner does, before the prompt's clock)")
        prompt = zlib.crc32(",".join(map(str, prompt_ids)).encode())
        rng = random.Random(self.seed * 1_000_003 + prompt)  # per prompt: independent of order and resumption
        return OracleProposer(self.shape, float(self.acceptance), truth, len(prompt_ids), lm.vocab_size, rng), None

    def generate(self, lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, stop_ids):
        """decode_one, after foresee(): a lookup where the runner foresaw this prompt before its clock."""
        check_sampling(self, sampling)
        self.foresee(lm, prompt_ids, max_new_tokens, stop_ids)
        return decode_one(self, lm, prompt_ids, max_new_tokens, sampling, stop_ids)
