"""Extra prediction heads on the target's last hidden state (Medusa; blockwise parallel decoding),
their file format, and the proposer both methods share.

Head i maps the hidden state at position t to a distribution over the token at t + i + 2 (the
model's own head predicts t + 1). Each head is Medusa's residual block, h + SiLU(W h + b) with
W zero-initialised, followed by the model's own output projection (tied, so it is neither
trained nor stored): an untrained head repeats the model's next-token prediction. The K
blocks' outputs go through the shared projection as one (K, d) x (d, V) matmul, so the
vocabulary matrix is read once per step whatever K is. Published Medusa-1 heads (published.py)
may have several blocks per head and an output layer each.

The readout may be limited to a draft vocabulary (`readout_vocab`: a file of token ids, as the
EAGLE draft's readout is): those rows of the output layer are read instead of all of them
(SmolLM2: 8192 of 49152 rows), and every other token scores -inf, so it is never drafted.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..core.lm import LM, soft_cap
from ..core.loop import Proposal, Scores
from ..core.tree import TokenTree
from ..core.weights_file import (addon_path, is_checkpoint_dir, load_checked, load_state, load_vocab, meta_int,
                                 save_weights)
from .published import read_medusa

HEADS_FORMAT = "medusa-heads-v1"


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.silu(self.linear(h))


class Heads(nn.Module):
    """K heads of `layers` residual blocks each, sharing the target's (frozen) output projection, or
    (own_outputs: published Medusa-1 heads) each with its own output layer."""

    def __init__(self, lm_head: nn.Module, hidden_size: int, k: int, layers: int = 1, own_outputs: bool = False,
                 cap: float | None = None):
        super().__init__()
        self.cap = cap  # the target's final logit soft-cap, applied after every readout as the target applies it
        # One block per head is a bare ResBlock, so that our files' keys stay blocks.{i}.linear.*.
        self.blocks = nn.ModuleList(ResBlock(hidden_size) if layers == 1 else
                                    nn.Sequential(*(ResBlock(hidden_size) for _ in range(layers))) for _ in range(k))
        vocab = lm_head.weight.shape[0]
        self.outputs = (nn.ModuleList(nn.Linear(hidden_size, vocab, bias=False) for _ in range(k)) if own_outputs
                        else None)
        self.lm_head = [lm_head]  # a list: not a submodule, so neither trained nor saved
        self.hidden_size, self.layers = hidden_size, layers
        self.info: dict = {}
        self.readout: list[nn.Linear] = []  # set by restrict_readout: a list, so never saved
        self.readout_ids: torch.Tensor | None = None  # the readout's token ids (column j is token readout_ids[j])

    @property
    def k(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., d) -> logits (K, ..., V); with a restricted readout, -inf outside its vocabulary."""
        stacked = [block(hidden) for block in self.blocks]
        if self.readout:
            if len(self.readout) == 1:  # the shared output layer's rows: one (K, d) x (d, V') matmul
                small = self.readout[0](torch.stack(stacked))
            else:  # a published checkpoint's own output layers, each sliced
                small = torch.stack([out(x) for out, x in zip(self.readout, stacked)])
            full = small.new_full((*small.shape[:-1], self.lm_head[0].weight.shape[0]), float("-inf"))
            # one scatter: the builders keep token ids
            return full.index_copy_(-1, self.readout_ids, soft_cap(small, self.cap))
        if self.outputs is not None:
            return soft_cap(torch.stack([out(x) for out, x in zip(self.outputs, stacked)]), self.cap)
        return soft_cap(self.lm_head[0](torch.stack(stacked)), self.cap)

    def flops(self) -> float:
        """FLOPs of one application (one hidden state): K heads' blocks and vocabulary projections."""
        d = self.lm_head[0].weight.shape[1]
        vocab = len(self.readout_ids) if self.readout_ids is not None else self.lm_head[0].weight.shape[0]
        return self.k * (self.layers * 2.0 * d * d + 2.0 * d * vocab)

    def accuracy(self) -> list[list[float]] | None:
        """Measured top-r accuracy per head (rows: heads; columns: rank r's hit rate), if recorded."""
        return self.info.get("accuracy")


def new_heads(lm: LM, k: int, seed: int | None = None) -> Heads:
    """Untrained heads (each repeats the model's next-token prediction until trained); `seed`
    perturbs them randomly instead, for exactness tests that need heads that disagree."""
    hidden = lm.config.get_text_config().hidden_size
    heads = Heads(lm.model.get_output_embeddings(), hidden, k, cap=lm.logit_cap)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for p in heads.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.5
    heads.requires_grad_(False)  # trained only by scripts/train_heads.py, which turns this back on
    # Beside their input (the last hidden state) and the head they share: lm.output_device.
    return heads.to(device=lm.output_device, dtype=lm.dtype).eval()


def save_heads(heads: Heads, path: str | Path, info: dict) -> None:
    if heads.layers != 1 or heads.outputs is not None:
        raise ValueError("our heads format holds one residual block per head on the target's output layer")
    save_weights(heads, path, HEADS_FORMAT,
                 {"k": str(heads.k), "hidden_size": str(heads.blocks[0].linear.weight.shape[0]),
                  "vocab_size": str(heads.lm_head[0].weight.shape[0]), "info": json.dumps(info)})


def load_heads(lm: LM, path: str | Path, check_base: bool = True) -> Heads:
    """Our heads file, or a published Medusa-1 checkpoint (a directory or a hub id)."""
    if is_checkpoint_dir(path):  # Medusa-1's layout: the checks and names are published.py's
        shape, where, state = read_medusa(lm, path, check_base)
        heads = Heads(lm.model.get_output_embeddings(), lm.config.get_text_config().hidden_size, shape["k"],
                      shape["layers"], shape["own_outputs"], cap=lm.logit_cap)
        load_state(heads, state, "decoder.heads", where, "the layout its config.json describes")
        heads.info = {"layout": "medusa1", "source": str(path)}
        ref = lm.model.get_input_embeddings().weight
        heads.requires_grad_(False)
        return lm.accelerate(heads.to(device=ref.device, dtype=ref.dtype).eval())
    meta, state, info = load_checked(
        lm, path, HEADS_FORMAT, "decoder.heads", "heads file",
        "train one with scripts/train_heads.py or set decoder.heads=null for untrained heads", check_base=check_base)
    where = addon_path(path)
    heads = new_heads(lm, meta_int(meta, "k", "decoder.heads", where))
    load_state(heads, {k: v.to(heads.blocks[0].linear.weight.dtype) for k, v in state.items()}, "decoder.heads",
               where, "heads of this target's shape")
    heads.info = info
    return lm.accelerate(heads)


def restrict_readout(lm: LM, heads: Heads, tokens: Sequence[int]) -> Heads:
    """Read only the rows `tokens` of the heads' output layer(s) (copies, on the fast path as the
    heads are); every other token scores -inf."""
    outs = list(heads.outputs) if heads.outputs is not None else [heads.lm_head[0]]
    vocab = torch.as_tensor(list(tokens), dtype=torch.long, device=outs[0].weight.device)
    heads.readout = []
    for out in outs:
        rows = nn.Linear(out.weight.shape[1], len(vocab), bias=out.bias is not None,
                         device=out.weight.device, dtype=out.weight.dtype)
        rows.weight = nn.Parameter(out.weight.detach()[vocab].clone(), requires_grad=False)
        if out.bias is not None:
            rows.bias = nn.Parameter(out.bias.detach()[vocab].clone(), requires_grad=False)
        heads.readout.append(lm.accelerate(rows.eval()))
    heads.readout_ids = vocab
    return heads


def heads_for(lm: LM, path: str | None, k: int, seed: int | None, check_base: bool = True,
              readout_vocab: str | None = None) -> tuple[Heads, dict]:
    """The heads at `path` (our file or a published checkpoint), or untrained (seed: random) heads
    without one, their readout limited to `readout_vocab` (load_vocab); and what tuning reports of it."""
    heads = load_heads(lm, path, check_base) if path else new_heads(lm, k, seed)
    tokens, info = load_vocab(lm, readout_vocab, check_base=check_base)
    return (restrict_readout(lm, heads, tokens) if tokens is not None else heads), info


# build(committed sequence, heads' logits (K, V)) -> (the tree to verify, drafting FLOPs beyond the
# heads (rescoring), step info)
Build = Callable[[Sequence[int], torch.Tensor], tuple[TokenTree, float, dict]]


class HeadsProposer:
    """The proposer Medusa and BPD share. Every target pass returns the hidden state of each tree
    node; the heads read the last accepted node's, whose logits gave the bonus token, and `build`
    turns their logits into the next tree. Candidates are deterministic (top-k of the heads), so
    greedy verification is exact and sampling uses deterministic-candidate acceptance."""

    waits_for_prefill = True  # the heads read the hidden state of the target's pass
    hidden, feature_layers = True, False

    def __init__(self, heads: Heads, build: Build):
        self.heads, self.build = heads, build
        self.head_flops = heads.flops()
        self.state: torch.Tensor | None = None  # the last committed token's hidden state: the heads' input
        self.rescore_flops, self.info = 0.0, {}  # this step's, from build(), for commit()

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        with torch.inference_mode():
            head_logits = self.heads(self.state).float()
            tree, self.rescore_flops, self.info = self.build(sequence, head_logits)
        return Proposal(tree, hidden=self.hidden, draft_forward_tokens=1,
                        draft_flops=self.head_flops + self.rescore_flops)

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        self.state = scores.hidden[path[-1]]
        tree = proposal.tree
        return {"draft_depth": max(tree.depths), "accepted_depth": len(path) - 1, "tree_size": len(tree),
                "paths": len(tree.leaves()), "head_flops": self.head_flops, "rescore_flops": self.rescore_flops,
                **self.info}

