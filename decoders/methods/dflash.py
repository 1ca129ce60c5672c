"""Block drafting (DFlash; P-EAGLE's one pass; DDTree's trees): the proposer and the method's settings.

The draft (block_draft.py) reads the target's fused features of the committed tokens and proposes the
B - 1 tokens after the last committed one in ONE draft forward: a distribution per block position, each
independent of the others. Where an EAGLE draft pays one draft forward per tree depth, this one pays one
per step, whatever the depth.

Verification (`tree`):
- chain: the block's drafts in a row. Greedy: each position's argmax. Sampling: each position's token
  drawn from its own distribution (the run's temperature, top-p, top-k applied to the draft's logits),
  verified by speculative sampling against the distribution it was drawn from.
- tree (DDTree's construction): the `tree_size` paths most probable under the block's independent
  per-position distributions, over each position's `top_k` tokens: tree.best_paths on the step's own
  probabilities (a path's probability is the product of its tokens' at their positions), tree.rank_tree
  for its shape. The candidates are deterministic given the distributions, so sampling verifies them
  as deterministic candidates (point-mass drafts), which keeps the target's distribution.

`tree_size=auto` sizes the tree for this device as tree_size=auto does for EAGLE's and Medusa's trees
(tuning/tree_size.py): of `auto_sizes`, the size whose tree forecasts the most tokens per unit of time,
a step costing a forward of size + 1 tokens (the cached latency profile) plus one draft forward
(block_seconds, timed at load), the same at every depth; the tree forecast from the draft's held-out
accuracy by block position (stored in its file; a prior without one).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from ..core.contract import PerTarget, check, check_step, decode_one
from ..core.kv_cache import KVCache
from ..core.lm import LM
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler
from ..core.transfer import to_device
from ..core.tree import TokenTree, best_paths, prior_accuracy, rank_tree
from ..tuning.profile import forward_latency, step_cost
from ..tuning.tree_size import check_sizes, choose_size
from .block_draft import BlockDraft, block_draft_for, block_seconds
from .eagle_draft import DRAFT_DTYPES

TREES = ("chain", "tree")


def ddtree(root: int, probs: torch.Tensor, ids: torch.Tensor, size: int) -> TokenTree:
    """DDTree's tree: the `size` most probable paths under independent per-position distributions.
    probs (depth, k): each position's top-k probabilities, largest first; ids (depth, k): their tokens.
    The paths are rank paths (best_paths: a path's value is the product of its ranks' probabilities,
    never above its prefix's, so the set is closed under prefixes); their tokens are the ranks' ids."""
    table = probs.tolist()
    shape = rank_tree(best_paths(table, size, len(table[0]) if table else 0))
    tokens = ids.tolist()
    return TokenTree([root, *(tokens[depth][rank] for depth, rank in shape.slots)], shape.parents)


class BlockDraftProposer:
    """The proposer: one draft forward a step feeds the committed rows the draft has not seen and drafts
    the block after them; the draft's cache keeps the committed rows and drops the block's."""

    waits_for_prefill = True  # the draft reads the target's features of the prompt first
    hidden = False

    def __init__(self, draft: BlockDraft, block: int, tree: str, tree_size: int, top_k: int, sampler: Sampler):
        self.draft, self.block, self.kind, self.tree_size, self.top_k = draft, block, tree, tree_size, top_k
        self.sampler = sampler
        self.feature_layers = draft.reads  # what every pass returns: the features the draft reads
        self.cache = KVCache(DynamicCache())
        self.pending: torch.Tensor | None = None  # (n, F): committed rows' features not yet fed to the draft

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        feats, self.pending = self.pending, None
        base, n, root = len(self.cache), feats.shape[0], int(sequence[-1])
        if base + n != len(sequence) - 1:
            raise RuntimeError(f"block draft cache holds {base + n} positions, expected {len(sequence) - 1}")
        draft = self.draft
        with torch.inference_mode():
            out = draft(feats, root, self.cache, self.block)  # (B, d): the block's rows, the root's first
            self.cache.crop(base + n)  # the committed rows stay; the block's go
            depth = max(0, min(self.block - 1, room))
            logits = draft.logits(out[1:1 + depth]).float()  # (depth, V'): positions after the root
            tree, draft_probs = self._tree(root, logits)
        # FLOPs: the fuse on the committed rows, the layers on every row, the readout on the drafted ones.
        flops = draft.flops(n + self.block, base, depth) + draft.fuse_flops * n
        prefill = draft.flops(n, 0, 0) + draft.fuse_flops * n if base == 0 else 0.0  # the draft's pass over the prompt
        return Proposal(tree, draft_probs=draft_probs, feature_layers=self.feature_layers,
                        draft_forward_tokens=n + self.block, draft_flops=flops, draft_prefill_flops=prefill)

    def _tree(self, root: int, logits: torch.Tensor) -> tuple[TokenTree, torch.Tensor | None]:
        """The tree verified and, for drawn drafts, the distributions they came from (row c: node c's)."""
        if len(logits) == 0:
            return TokenTree.chain(root, []), None
        vocab = self.draft.vocab.to(logits.device)
        if self.kind == "tree":
            top, idx = torch.softmax(logits, -1).topk(min(self.top_k, logits.shape[-1]), -1)  # (depth, k)
            return ddtree(root, top, vocab[idx], self.tree_size), None
        if self.sampler.greedy:
            return TokenTree.chain(root, vocab[logits.argmax(-1)].tolist()), None
        full = logits.new_full((len(logits), self.draft.target.lm.vocab_size), float("-inf"))  # (depth, V)
        q = self.sampler.probs(full.index_copy_(1, vocab, logits))  # (depth, V): each position's own
        drafts = torch.multinomial(q, 1, generator=self.sampler.generator)[:, 0]  # (depth,)
        return TokenTree.chain(root, drafts.tolist()), torch.cat([torch.zeros_like(q[:1]), q])

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        # The committed positions scored this step (the uncached tokens, then the accepted nodes): the
        # draft's next context rows. (When the output ended mid-path, the loop stops and they are never read.)
        u = scores.features.shape[0] - len(proposal.tree) + 1
        rows = list(range(u)) + [u - 1 + i for i in path[1:]]
        self.pending = scores.features.index_select(0, to_device(rows, scores.features.device, torch.long))
        tree = proposal.tree
        return {"draft_depth": max(tree.depths), "accepted_depth": len(path) - 1, "tree_size": len(tree),
                "draft_forwards": 1}


@dataclass
class DFlash:
    draft_weights: str | None = "adapters/smollm2-135m-dflash.safetensors"  # ours; None = untrained
    draft_seed: int | None = None  # draft_weights=null: a random draft from this seed (exactness tests)
    block_size: int = 8  # B: the root and B - 1 drafted positions, all in one draft forward
    tree: str = "tree"  # chain | tree (DDTree's)
    tree_size: Any = "auto"  # tree: draft nodes verified; auto: of auto_sizes, the best on this device
    top_k: int = 4  # tree: ranks per block position its paths may take
    auto_sizes: list = field(default_factory=lambda: [2, 4, 6, 8, 12, 16, 24, 32])
    cache_dir: str | None = None  # where tree_size=auto finds (or keeps) this device's latency profile
    check_base: bool = True  # refuse a draft made for another base model (by the name its file records)
    draft_dtype: str | None = None  # the draft's own weights: None = the target's dtype, or one of DRAFT_DTYPES
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    _draft: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)

    def __post_init__(self):
        check("tree", self.tree, one_of=TREES)
        check("top_k", self.top_k, at_least=1)
        check("block_size", self.block_size, at_least=2)
        check("draft_dtype", self.draft_dtype, one_of=tuple(DRAFT_DTYPES), also=(None,))
        widest = check_sizes(self.tree_size, self.auto_sizes)
        self.widest_step = check_step(1 + widest if self.tree == "tree" else self.block_size,
                                      f"1 + tree size {widest}" if self.tree == "tree" else "block size")
        self.lossless = True
        self.tuning: dict = {}
        self._sized = None  # tree_size=auto: (draft, block, size, what auto reports)

    def load_addons(self, lm: LM) -> BlockDraft:
        """The draft, built before any timing (a bad file fails in one line)."""
        return self._draft.get(lm, lambda: block_draft_for(lm, self.draft_weights, self.draft_seed, self.check_base,
                                                           self.draft_dtype))

    def accuracy(self, draft: BlockDraft, depth: int) -> tuple[list[list[float]], str]:
        """acc[i][r] for block positions <= depth and ranks < top_k: the draft's measured, else the prior."""
        measured = draft.accuracy()
        rows = [row[:self.top_k] for row in measured[:depth]] if measured else None
        return (rows, "measured") if rows else (prior_accuracy(depth, self.top_k), "prior")

    def sized(self, lm: LM, draft: BlockDraft) -> int:
        """tree_size: as configured, or tree_size=auto's choice for this device (made once per draft)."""
        if self.tree_size != "auto":
            return self.tree_size
        block = self.block_size
        if self._sized is None or self._sized[:2] != (draft, block):
            profile = forward_latency(lm, self.cache_dir, max_tokens=max(self.auto_sizes) + 1)
            draft_cost = block_seconds(lm, draft, block) / profile["autoregressive_s"]
            accuracy, source = self.accuracy(draft, block - 1)
            size, info, _ = choose_size(accuracy, self.top_k, self.auto_sizes, functools.partial(step_cost, profile),
                                        lambda depth: draft_cost)
            self._sized = (draft, block, size, {**info, "draft_cost": draft_cost, "source": source})
        return self._sized[2]

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        draft = self.load_addons(lm)
        block = self.block_size
        size = self.sized(lm, draft) if self.tree == "tree" else block - 1
        self.tuning = {"tree": self.tree, "block_size": block, "tree_size": size, "top_k": self.top_k,
                       "draft_vocab": len(draft.vocab), "draft_dtype": str(draft.dtype).replace("torch.", "")}
        if self.tree == "tree" and self.tree_size == "auto":
            self.tuning.update(auto=True, **self._sized[3])
        return BlockDraftProposer(draft, block, self.tree, size, self.top_k, sampler), None

    generate = decode_one  # one prompt through the shared loop
