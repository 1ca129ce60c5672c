"""Blockwise parallel decoding (Stern et al. 2018) with lattice rescoring (Kim et al. 2024).

The heads draft a block of `block` tokens after the next one in one shot (head i: position
i + 2). Plain BPD verifies the block of each head's top-1 (`rescore=none`, `paths=1`). Kim et
al.'s refinement treats the heads' top-k tokens per position as a lattice and rescores its
paths with a small LM that sees the committed text: a beam search of width `paths` over
    score(path) = sum_i [ log p_head_i(x_i) + weight * log p_LM(x_i | text, x_<i) ]
and verifies the `paths` best paths in one target pass, merged into a trie. The LM is an
n-gram model over token ids (`rescore=ngram`, scripts/train_ngram.py) or a small neural LM
(`rescore=neural`: the draft group's model, by default the target's first layers + exit
adapter). `rescore=none` with paths > 1 ranks paths by the heads alone. Greedy is exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..core.contract import PerTarget, check, check_step, decode_one
from ..core.weights_file import addon_path
from .draft_model import DRAFT_REQUIRED, build_draft
from .heads import HeadsProposer, heads_for
from ..core.kv_cache import KVCache
from ..core.lm import LM, forward_flops
from .ngram_lm import NgramLM
from ..core.sampling import Sampler
from ..core.tree import TokenTree

# score_next(paths (B, j), parent (B,) each path's prefix's row among the previous call's paths (None at
# j = 0), candidates (top_k,)) -> (B, top_k) LM log-scores of each candidate after each path
ScoreNext = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]


def lattice_beam_search(head_logp: torch.Tensor, top_k: int, width: int, weight: float,
                        score_next: ScoreNext | None, on_host: bool = True) -> list[tuple[int, ...]]:
    """The `width` best paths through the lattice of each position's top_k tokens.
    head_logp: (positions, V) log-probabilities. score_next scores candidates after the paths, on the
    search's device; None ranks by the heads alone. on_host: the lattice reaches the host in one read
    and the paths are ranked there (an n-gram LM scores on the host; on a GPU every read of a beam's
    index made the host wait: 21 waits a step on an H200, results/reference/gpu/). Otherwise the search
    stays where head_logp is (a neural LM scores there) and only the chosen paths are read."""
    lp_all, cand_all = torch.topk(head_logp, top_k, dim=-1)  # (positions, top_k) each
    if on_host:  # one read for both: float64 holds every id and every narrower float exactly
        lattice = torch.stack([lp_all.double(), cand_all.double()]).cpu()
        lp_all, cand_all = lattice[0].to(head_logp.dtype), lattice[1].long()
    paths = cand_all.new_zeros(1, 0)  # (B, j) the beams so far
    scores, parent = lp_all.new_zeros(1), None  # (B,)
    for lp, cand in zip(lp_all, cand_all):  # (top_k,) each
        total = scores[:, None] + lp[None, :]  # (B, top_k)
        if score_next is not None:
            total = total + weight * score_next(paths, parent, cand)
        best = torch.topk(total.flatten(), min(width, total.numel())).indices  # (B',)
        parent = best // top_k
        paths = torch.cat([paths[parent], cand[best % top_k][:, None]], 1)
        scores = total.flatten()[best]
    return [tuple(p) for p in paths.tolist()]


class NeuralScorer:
    """A small LM's log-probabilities along the beams (a ScoreNext), one forward per lattice position:
    each beam's newest token is fed under a mask (committed text + its own earlier tokens) built on the
    LM's device from the beams' parents; the cache is cropped back to the committed text afterwards."""

    def __init__(self, draft: LM):
        self.draft = draft
        self.cache: KVCache | None = None

    def start(self, sequence: Sequence[int]) -> float:
        """Catch up on the committed text; returns the forward's FLOPs (self.flops adds each level's)."""
        if self.cache is None:
            self.cache = self.draft.new_cache()
        context = len(self.cache)
        logits = self.draft.forward(list(sequence[context:]), self.cache, last_only=True)
        self.committed = len(sequence)
        self.first = torch.log_softmax(logits[-1].float(), -1)  # (V,) after the committed text
        self.seen: torch.Tensor | None = None  # (B, tree rows fed) bool: what the last fed beams saw
        self.flops = forward_flops(self.draft.flops_spec(), len(sequence) - context, context)
        return self.flops

    def __call__(self, paths: torch.Tensor, parent: torch.Tensor | None, cand: torch.Tensor) -> torch.Tensor:
        if not paths.shape[1]:
            logp = self.first[None]  # (1, V)
        else:
            b, base, device = len(paths), len(self.cache), self.draft.device
            own = torch.eye(b, dtype=torch.bool, device=device)
            # a beam sees the rows its parent saw (its own earlier tokens) and itself
            seen = own if self.seen is None else torch.cat([self.seen[parent.to(device)], own], 1)
            mask = torch.cat([seen.new_ones(b, self.committed), seen], 1)  # (B, base + B)
            positions = torch.full((b,), self.committed - 1 + paths.shape[1], device=device)
            logits = self.draft.forward(paths[:, -1].to(device), self.cache, position_ids=positions, mask=mask)
            self.seen = seen
            self.flops += forward_flops(self.draft.flops_spec(), b, base)
            logp = torch.log_softmax(logits.float(), -1)  # (B, V)
        return torch.gather(logp, 1, cand.to(logp.device).expand(len(logp), -1))

    def finish(self) -> None:
        self.cache.crop(self.committed)


@dataclass
class BPD:
    heads: str | None = None  # a heads file (scripts/train_heads.py); null = untrained heads
    num_heads: int = 4  # heads to build when heads=null
    heads_seed: int | None = None  # heads=null: random heads from this seed (exactness tests)
    block: int | None = None  # drafted tokens after the next one; null = one per head
    rescore: str = "none"  # none | ngram | neural
    ranks_per_head: int = 4  # lattice width: each head's top ranks considered per position
    paths: int = 1  # best paths verified together
    weight: float = 1.0  # LM log-score weight against the heads'
    ngram: str | None = None  # n-gram LM file (scripts/train_ngram.py), for rescore=ngram
    draft: Any = None  # the neural rescorer, for rescore=neural (draft=self or a model config)
    readout_vocab: str | None = "auto"  # auto | full | a vocabulary file: the tokens the heads may draft
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    _heads: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)
    _drafts: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)
    target_needs = {"hidden": "its heads read it", "weights": "its heads share the target's output head"}

    def __post_init__(self):
        for key in ("num_heads", "ranks_per_head", "paths"):
            check(key, getattr(self, key), at_least=1)
        check("block", self.block, at_least=1, also=(None,))
        check("rescore", self.rescore, one_of=("none", "ngram", "neural"))
        block = self.num_heads if self.block is None else self.block
        self.widest_step = check_step(1 + self.paths * block, f"1 + paths {self.paths} x block {block}")
        if not self.weight >= 0:
            raise ValueError(f"decoder.weight must be >= 0, got {self.weight}")
        if self.rescore == "ngram" and not self.ngram:
            raise ValueError("decoder.rescore=ngram needs decoder.ngram=FILE (scripts/train_ngram.py)")
        if self.rescore == "ngram" and not addon_path(self.ngram).is_file():
            raise ValueError(f"decoder.ngram: no n-gram LM at {addon_path(self.ngram)}; "
                             "train one with scripts/train_ngram.py")
        if self.rescore == "neural":
            check("draft", self.draft, required=f"rescore=neural rescores with it: {DRAFT_REQUIRED}")
        self._ngram: NgramLM | None = None
        self.tuning: dict = {}  # the heads' readout vocabulary, once loaded

    def load_addons(self, lm: LM):
        """Heads (and the rescoring LM) are built before timing; bad files fail in one line."""
        heads, self.tuning = self._heads.get(lm, lambda: heads_for(lm, self.heads, self.num_heads, self.heads_seed,
                                                                   readout_vocab=self.readout_vocab))
        if self.block is not None and self.block > heads.k:
            raise ValueError(f"decoder.block={self.block} needs as many heads; these heads have {heads.k}")
        if self.rescore == "ngram" and self._ngram is None:
            self._ngram = NgramLM.shared(addon_path(self.ngram))
        if self.rescore == "neural":
            self._drafts.get(lm, lambda: build_draft(self.draft, lm))
        return heads

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        """One prompt's proposer; the neural rescorer's cache is its own (a row of a batch keeps its text there)."""
        heads = self.load_addons(lm)
        block = self.block or heads.k
        ngram = self._ngram
        neural = (NeuralScorer(self._drafts.get(lm, lambda: build_draft(self.draft, lm)))
                  if self.rescore == "neural" else None)

        def build(sequence, head_logits):
            head_logp = torch.log_softmax(head_logits[:block], dim=-1)
            score_next = None
            if self.rescore == "ngram":
                context = list(sequence[-(ngram.order - 1):]) if ngram.order > 1 else []

                def score_next(paths, parent, cand):
                    return torch.tensor([[ngram.score(context + path, t) for t in cand.tolist()]
                                         for path in paths.tolist()])
            elif neural is not None:
                neural.start(sequence)
                score_next = neural
            beams = lattice_beam_search(head_logp, self.ranks_per_head, self.paths, self.weight, score_next,
                                        on_host=neural is None)
            if neural is not None:
                neural.finish()
            tree = TokenTree.from_sequences(int(sequence[-1]), beams)
            return tree, neural.flops if neural is not None else 0.0, {}

        return HeadsProposer(heads, build), None

    generate = decode_one  # one prompt through the shared loop

