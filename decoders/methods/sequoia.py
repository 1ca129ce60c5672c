"""Sequoia (Chen et al. 2024): a DP-optimal token tree drafted without replacement,
verified in one target pass with Sequoia's sampling-without-replacement rule.

The tree's shape comes from decoders/tuning/sequoia_tree.py: the tree of `budget` draft nodes and
depth <= `depth` that maximises expected tokens per step under the measured acceptance vector
(p_k: probability that the k-th drafted child is the accepted one). `tree=auto` also picks
(budget, depth) for this device: the least predicted time per token given the measured
target and draft latencies. Greedy drafts a node's top-c tokens; sampling draws c without
replacement from the draft, and rejection updates the target's residual and drops the
rejected token from the draft's distribution before trying the next sibling.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.contract import PerTarget, check, check_list, check_step, decode_one
from ..core.lm import LM
from ..core.sampling import Sampler, Sampling
from ..core.tree import drafted_tree
from ..tuning.sequoia_acceptance import cached_acceptance, device_latency, load_acceptance
from ..tuning.sequoia_tree import choose_tree, optimal_tree
from .draft_model import DRAFT_REQUIRED, build_draft, draft_needs
from .draft_tree import DraftTreeProposer, draft_tree, stacked_dists


@dataclass
class Sequoia:
    draft: Any = None  # draft=self or a model config
    budget: int = 16  # draft nodes per step (the target verifies budget + 1 tokens)
    depth: int = 6  # deepest draft level
    tree: str = "fixed"  # fixed: (budget, depth) as given; auto: chosen for this device
    acceptance_file: str | None = None  # a measured acceptance-vector JSON; null = measure on calibration prompts
    K: int = 8  # children per node measured (and allowed)
    auto_budgets: list = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    auto_depths: list = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    auto_prompts: int = 2
    auto_tokens: int = 48
    cache_dir: str | None = None
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    _drafts: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)

    target_needs = property(lambda self: draft_needs(self.draft))  # contract.check_engine

    def __post_init__(self):
        for key in ("budget", "depth", "K", "auto_prompts", "auto_tokens"):
            check(key, getattr(self, key), at_least=1)
        check("tree", self.tree, one_of=("fixed", "auto"))
        for key in ("auto_budgets", "auto_depths"):
            check_list(key, getattr(self, key), at_least=1)
        budget = max(self.budget, *self.auto_budgets) if self.tree == "auto" else self.budget
        self.widest_step = check_step(1 + budget, f"1 + budget {budget}")
        check("draft", self.draft, required=DRAFT_REQUIRED)
        if self.acceptance_file is not None and not Path(self.acceptance_file).expanduser().is_file():
            raise ValueError(f"decoder.acceptance_file: no acceptance vector at {self.acceptance_file}; "
                             "measure one with "
                             f"scripts/measure_acceptance.py or leave it null to measure on calibration prompts")
        if self.acceptance_file is not None:  # a damaged file fails here, before any model loads
            try:
                load_acceptance(self.acceptance_file)
            except ValueError as e:
                raise ValueError(f"decoder.acceptance_file: {e}") from None
        self._shape = None
        self.tuning: dict = {}

    @property
    def calibration_prompts(self) -> int:
        """Prompts prepare() wants: to measure acceptance (no file given) and/or choose the tree."""
        return self.auto_prompts if (self.acceptance_file is None or self.tree == "auto") else 0

    def load_addons(self, lm: LM) -> LM:
        return self._drafts.get(lm, lambda: build_draft(self.draft, lm))

    def prepare(self, lm: LM, prompts, stop_ids, sampling: Sampling | None = None) -> None:
        """Acceptance vector (file, or measured greedily on `prompts` and cached), then the tree."""
        draft = self.load_addons(lm)
        if self.acceptance_file is not None:
            acceptance = load_acceptance(self.acceptance_file)
        else:
            # at the run's sampling settings: acceptance at T > 0 is not greedy acceptance
            acceptance = cached_acceptance(lm, draft, prompts[:self.auto_prompts], self.K, sampling or Sampling(),
                                           self.auto_tokens, cache_dir=self.cache_dir)
        acceptance = list(acceptance)[:self.K]
        if self.tree == "auto":
            target_s, draft_s, ar_s = device_latency(lm, draft, self.cache_dir)
            shape, info = choose_tree(acceptance, target_s, draft_s, self.auto_budgets, self.auto_depths, ar_s)
            info = {k: v for k, v in info.items() if k != "table"}
        else:
            shape = optimal_tree(acceptance, self.budget, self.depth)
            info = {"budget": self.budget, "depth": self.depth}
        self._shape = shape
        self.tuning = {**info, "expected_tokens": shape.expected_tokens, "tree_size": shape.size,
                       "acceptance": [round(a, 4) for a in acceptance]}
        self.tuning.setdefault("predicted_speedup", float("nan"))

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        if self._shape is None:
            if self.calibration_prompts:
                self.prepare(lm, [list(prompt_ids)], stop_ids, sampler.sampling)  # outside the harness: this prompt
            else:
                self.prepare(lm, [], stop_ids, sampler.sampling)
        parents = self._shape.parents

        def grow(draft_lm, cache, sequence):
            dtree = draft_tree(draft_lm, cache, sequence, parents, sampler, replacement=False)
            tree = drafted_tree(dtree.tokens[0], dtree.tokens[1:], dtree.parents)  # on a GPU read with verification
            return tree, stacked_dists(dtree.dists), list(range(len(tree))), dtree, None

        return DraftTreeProposer(self.load_addons(lm), len(prompt_ids), grow, without_replacement=True), None

    generate = decode_one  # one prompt through the shared loop
