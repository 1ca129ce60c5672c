"""Medusa (Cai et al. 2024): a tree of candidates from the heads' top-k, verified in one pass.

A `choice` is a path of ranks: (r0, r1, ...) is the candidate whose first token is head 0's
rank-r0 token, whose second is head 1's rank-r1 token, and so on; the tree holds a set of such
paths closed under prefixes. `choices`:
- auto: the `tree_size` paths with the highest product of measured head accuracies (the
  accuracy table train_heads.py stores with the heads; the generic prior if it has none).
  `tree_size=auto` sizes that tree for this device, as Sequoia's tree=auto does: of
  `auto_sizes`, the size with the most forecast tokens per unit of time, a step costing a
  forward of size + 1 tokens (the cached latency profile, decoders/tuning/profile.py) plus the
  heads (timed here), both in autoregressive steps,
- chain: the top-1 of every head (one candidate),
- prior: as auto, from a fixed prior (head i's rank-r accuracy 0.6^(i+1) 0.5^r), for heads never measured,
- or an explicit list of paths, e.g. [[0], [1], [0, 0]].

Greedy (and sampling with deterministic-candidate acceptance) is exact. `acceptance=typical`
is Medusa's typical acceptance: a candidate passes when the target gives it probability above
min(posterior_threshold, posterior_alpha * exp(-entropy)); lossy, and flagged so in records.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core.contract import PerTarget, check, check_step, decode_one
from .heads import HeadsProposer, heads_for
from ..core.lm import LM
from ..core.sampling import Sampler
from ..core.transfer import to_device
from ..core.tree import TokenTree, best_paths, drafted_tree, given_paths, prior_accuracy, published_trees, rank_tree
from ..tuning.profile import forward_latency, step_cost
from ..tuning.tree_size import check_sizes, choose_size, expected_tokens


def typical_accept(tree: TokenTree, logits: torch.Tensor, sampler: Sampler, threshold: float, alpha: float):
    """Medusa's typical acceptance: the longest path whose tokens each clear the posterior
    threshold at their parent; the next token from the last node as the sampler would draw it."""
    temperature = sampler.sampling.temperature if not sampler.greedy else 1.0
    p = torch.softmax(logits.float() / temperature, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-20))).sum(-1)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    path = tree.longest_path(lambda node, child: bool(p[node, tree.tokens[child]] > bar[node]))
    return path, sampler.next_token(logits[path[-1]])


def heads_seconds(lm: LM, heads, repeats: int = 5) -> float:
    """Seconds of one application of the heads to one hidden state, as each step applies them
    (the fastest of `repeats`, after a warm-up)."""
    weight = next(heads.blocks.parameters())  # any block's: a head may hold several (published Medusa-1)
    hidden = torch.zeros(heads.hidden_size, dtype=weight.dtype, device=weight.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            lm.sync()
            start = time.perf_counter()
            heads(hidden).float()
            lm.sync()
            times.append(time.perf_counter() - start)
    return min(times[1:])


@dataclass
class Medusa:
    heads: str | None = None  # a heads file (scripts/train_heads.py), a Medusa-1 directory or hub id; null = untrained
    num_heads: int = 4  # heads to build when heads=null
    heads_seed: int | None = None  # heads=null: random heads from this seed (exactness tests)
    choices: Any = "auto"  # auto | chain | prior | mc_sim_7b_63 (Medusa-1's, published_trees.json) | rank paths
    tree_size: Any = 32  # candidate nodes for auto / prior; auto: the size of auto_sizes best on this device
    ranks_per_head: int = 10  # ranks per head that auto / prior may use
    auto_sizes: list = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    cache_dir: str | None = None  # where tree_size=auto finds (or keeps) this device's latency profile
    accept_rule: str = "exact"  # exact | typical (lossy)
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    check_base: bool = True  # refuse heads made for another base model (by the name their file records)
    readout_vocab: str | None = "auto"  # auto | full | a vocabulary file: the tokens the heads may draft
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    _heads: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)
    target_needs = {"hidden": "its heads read it", "weights": "its heads share the target's output head"}

    def __post_init__(self):
        for key in ("num_heads", "ranks_per_head"):
            check(key, getattr(self, key), at_least=1)
        widest = check_sizes(self.tree_size, self.auto_sizes)
        check("accept_rule", self.accept_rule, one_of=("exact", "typical"))
        if not (0 < self.posterior_threshold <= 1 and 0 < self.posterior_alpha <= 1):
            raise ValueError(f"decoder.posterior_threshold and posterior_alpha must be in (0, 1], got "
                             f"{self.posterior_threshold} and {self.posterior_alpha}")
        self._given = None if self.choices in ("auto", "chain", "prior") else given_paths("choices", self.choices,
                                                                                            "medusa")
        if self.choices not in ("auto", "chain", "prior") and self._given is None:
            raise ValueError("decoder.choices must be auto, chain, prior, a tree its authors published ("
                             f"{', '.join(published_trees()['medusa'])}) or a list of rank paths, got {self.choices!r}")
        size = len(self._given) if self._given is not None else widest
        self.widest_step = check_step(1 + size, f"1 + tree size {size}")
        self.lossless = self.accept_rule == "exact"
        self.tuning: dict = {}
        self._tree = None  # (heads, the rank tree built for them)
        self._readout: dict = {}  # the heads' readout vocabulary, as tuning reports it

    def load_addons(self, lm: LM):
        """The heads, built before any timing (a bad heads file fails in one line)."""
        heads, self._readout = self._heads.get(lm, lambda: heads_for(lm, self.heads, self.num_heads, self.heads_seed,
                                                                     self.check_base, self.readout_vocab))
        return heads

    def paths(self, heads, lm: LM | None = None) -> tuple[list[tuple[int, ...]], str, float | None]:
        """The tree's rank paths, where they came from, and (auto / prior) the mean accepted tokens
        they forecast. tree_size=auto needs `lm` (its latency) and sets self.tuning's choice."""
        if self.choices == "chain":
            return [(0,) * d for d in range(1, heads.k + 1)], "chain", None
        if self.choices in ("auto", "prior"):
            measured = heads.accuracy() if self.choices == "auto" else None
            accuracy = measured or prior_accuracy(heads.k, self.ranks_per_head)
            size = self.tree_size
            if size == "auto":
                verify_cost, heads_cost = self.costs(lm, heads)
                size, info, _ = choose_size(accuracy, self.ranks_per_head, self.auto_sizes, verify_cost,
                                            lambda depth: heads_cost)
                self.tuning = {"predicted_speedup": info["predicted_speedup"], "heads_cost": heads_cost}
            paths = best_paths(accuracy, size, self.ranks_per_head)
            return paths, "measured" if measured else "prior", expected_tokens(accuracy, paths)
        paths = self._given
        if max(map(len, paths)) > heads.k:
            raise ValueError(f"decoder.choices: a path of depth {max(map(len, paths))} needs that many heads; "
                             f"these heads have {heads.k}")
        return paths, "published" if isinstance(self.choices, str) else "given", None

    def costs(self, lm: LM, heads) -> tuple[Callable[[int], float], float]:
        """This device's cost, in autoregressive steps, of verifying k tokens (k -> cost), and of one
        application of the heads."""
        profile = forward_latency(lm, self.cache_dir, max_tokens=max(self.auto_sizes) + 1)
        return functools.partial(step_cost, profile), heads_seconds(lm, heads) / profile["autoregressive_s"]

    def tree_for(self, lm: LM):
        """The heads and the rank tree they fill, built once per heads."""
        heads = self.load_addons(lm)
        if self._tree is None or self._tree[0] is not heads:
            self.tuning = {}
            paths, source, expected = self.paths(heads, lm)
            self._tree = (heads, rank_tree(paths))
            self.tuning = {**self.tuning, **self._readout, "tree_size": len(self._tree[1].slots),
                           "depth": max((len(p) for p in paths), default=0),
                           "choices": self.choices if isinstance(self.choices, str) else "list", "source": source}
            if expected is not None:
                self.tuning["expected_tokens"] = expected
        return self._tree

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        heads, (parents, slots) = self.tree_for(lm)
        ranks = min(max((r for _, r in slots), default=0) + 1, lm.vocab_size)
        picked = to_device([h * ranks + r for h, r in slots], lm.output_device, torch.long)  # (n - 1,) in (K * R)

        def build(sequence, head_logits):  # (K, V) -> the tree: on a GPU it stays there, read with verification
            top = torch.topk(head_logits, ranks, dim=-1).indices  # (K, R)
            drafts = top.view(-1).index_select(0, picked.to(top.device))  # (n - 1,)
            return drafted_tree(int(sequence[-1]), drafts, parents), 0.0, {}

        accept = None  # exact verification
        if self.accept_rule == "typical":
            accept = functools.partial(typical_accept, threshold=self.posterior_threshold, alpha=self.posterior_alpha)
        return HeadsProposer(heads, build), accept

    generate = decode_one  # one prompt through the shared loop
