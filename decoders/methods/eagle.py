"""EAGLE (Li et al. 2024; EAGLE-2, Li et al. 2024b): a one-layer draft over the target's own features.

The draft reads the target's features at position t (its last layer's output, before the final
norm) and the embedding of token t+1, fuses them (a 2d -> d linear), runs one decoder layer of the
target's own architecture (transformers' class, a fresh copy) and predicts the features at t+1;
the target's own final norm and output head read the next token from them. It drafts
autoregressively in feature space: a drafted node's input is its parent's predicted features and
its own token. The draft keeps its own KV cache of committed positions (real features); tree
nodes are appended while drafting and cropped before the target verifies.

Trees (`tree`):
- dynamic (EAGLE-2): the root's `top_k` best tokens; at each further depth the `top_k` nodes of
  the last depth with the highest cumulative draft log-probability are expanded, `top_k`
  children each; finally the `tree_size` nodes of highest cumulative log-probability are
  verified (closed under prefixes: a child never scores above its parent).
- static (EAGLE-1): a fixed tree of rank paths, the `tree_size` paths of depth <= `depth` most
  likely under the draft's per-depth rank accuracy measured at training (stored in the file;
  a generic prior without one).

The readout may be limited to a draft vocabulary (the file's `vocab`: the tokens the target
emits most, as in FR-Spec and EAGLE-3): a full 49k-row head costs this 135M target about a fifth
of its own step, paid again at every depth. A token outside it is never drafted; verification is
unchanged. Candidates are deterministic (top-k), so greedy is exact and sampling uses
deterministic-candidate acceptance, which keeps the target's distribution.

`draft_weights` may also be a published EAGLE-1/2 or EAGLE-3 checkpoint (published.py): the proposer reads
any draft through the same few members (`reads`, `from_target`, forward, `logits`, `vocab`, `flops`).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from transformers import DynamicCache

from ..core.contract import PerTarget, check, check_step, decode_one
from ..core.kv_cache import KVCache, cache_kwarg, causal_mask, level_mask
from ..core.lm import LM, TargetParts
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler
from ..core.tree import (RankTree, TokenTree, ancestors, best_paths, given_paths, prior_accuracy, published_trees,
                         rank_tree)
from ..core.weights_file import addon_path, is_checkpoint_dir, load_checked, load_state, meta_json, save_weights

EAGLE_FORMAT = "eagle-draft-v1"


def _one_layer_config(lm: LM):
    cfg = copy.deepcopy(lm.config.get_text_config())
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:1]
    return cfg


class FeatureDraft(nn.Module):
    """fuse(features_t, embedding(token_t+1)) -> one decoder layer -> features_t+1. Only `fuse`
    and `layer` are trained and saved; the embedding, final norm and head are the target's."""

    def __init__(self, lm: LM, vocab: Sequence[int] | None = None):
        super().__init__()
        base = lm.model.base_model
        cfg = _one_layer_config(lm)
        d = cfg.hidden_size
        self.fuse = nn.Linear(2 * d, d)
        self.layer = type(base.layers[0])(cfg, layer_idx=0)
        # Identity start: features_t+1 := features_t (the fuse passes the features through, the layer's
        # residual branches output zero), a stable point to train from.
        with torch.no_grad():
            self.fuse.weight.zero_()
            self.fuse.weight[:, :d] = torch.eye(d)
            self.fuse.bias.zero_()
            for name, module in self.layer.named_modules():
                if name.endswith(("o_proj", "down_proj")) and isinstance(module, nn.Linear):
                    module.weight.zero_()
        head = lm.model.get_output_embeddings()
        full = head.weight.shape[0]
        self.vocab = torch.as_tensor(list(vocab) if vocab is not None else range(full), dtype=torch.long)
        if len(self.vocab) == 0 or int(self.vocab.min()) < 0 or int(self.vocab.max()) >= full:
            raise ValueError(f"a draft vocabulary holds token ids in [0, {full}), got {len(self.vocab)} ids")
        readout = nn.Linear(d, len(self.vocab), bias=head.bias is not None)
        with torch.no_grad():
            readout.weight = head.weight if vocab is None else nn.Parameter(head.weight[self.vocab].clone())
            if head.bias is not None:
                readout.bias = nn.Parameter(head.bias[self.vocab].clone())
        readout.requires_grad_(False)
        # The readout (a slice of the target's head) and the rotary table: target parts, neither trained nor saved.
        self.target = TargetParts(lm, readout=readout, rotary=type(base.rotary_emb)(config=cfg))
        self.info: dict = {}
        self.dense_params = sum(m.weight.numel() for m in (self.fuse, *self.layer.modules())
                                if isinstance(m, nn.Linear))

    # What the proposer asks of a draft (the published layouts in published.py answer the same):
    reads = True  # the target's features it reads (LM.forward's `features`): the last layer's output, pre-norm

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features -> the draft's input features (here the same)."""
        return features

    @property
    def dtype(self) -> torch.dtype:
        return self.fuse.weight.dtype

    @property
    def readout(self) -> nn.Linear:
        return self.target.readout

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """features (..., q, d) and tokens (..., q) at `positions` (q,), each row seeing the keys
        `mask` (q, len(cache) + q) allows -> predicted next features (..., q, d). Rows are appended
        to `cache` when given."""
        lm, rotary = self.target.lm, self.target.rotary
        batched = features.dim() == 3
        if not batched:
            features, tokens = features[None], tokens[None]
        # The embedding sits at the model's input (lm.device), the features at its output (lm.output_device).
        x = self.fuse(torch.cat([features, lm.model.get_input_embeddings()(tokens.to(lm.device)).to(features)], -1))
        pos = positions.reshape(1, -1).to(x.device)
        out = self.layer(x, attention_mask=lm.mask_4d(mask).to(x.device), position_ids=pos,
                         **{cache_kwarg(self.layer): cache.hf if cache is not None else None},
                         use_cache=cache is not None, position_embeddings=rotary(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        return out if batched else out[0]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary (column j is token self.vocab[j])."""
        readout = self.readout  # the target's norm (its dtype) before it: a draft_dtype draft casts here
        return readout(self.target.lm.final_norm(features).to(readout.weight.dtype))

    def flops(self, rows: int, context: int, logit_rows: int) -> float:
        """One forward of `rows` rows after `context` cached ones, `logit_rows` of them read out."""
        attn = self.layer.self_attn.o_proj.weight.shape[1]
        attended = rows * context + rows * (rows + 1) / 2
        return 2.0 * self.dense_params * rows + 4.0 * attn * attended + 2.0 * self.readout.weight.numel() * logit_rows

    def accuracy(self) -> list[list[float]] | None:
        """acc[j][r]: how often rank r at depth j + 1 was the target's greedy token, on held-out text."""
        return self.info.get("accuracy")


def new_draft(lm: LM, vocab: Sequence[int] | None = None, seed: int | None = None) -> FeatureDraft:
    """An untrained draft (it predicts that features stay as they are); `seed` perturbs it randomly,
    for exactness tests that need drafts that disagree."""
    draft = FeatureDraft(lm, vocab)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    draft.requires_grad_(False)  # trained only by scripts/train_eagle.py, which turns this back on
    # Beside its input (the last layer's features), the final norm and the head: lm.output_device.
    return draft.to(device=lm.output_device, dtype=lm.dtype).eval()


def save_draft(draft: FeatureDraft, path: str | Path, info: dict) -> None:
    full = draft.target.lm.vocab_size
    vocab = (None if len(draft.vocab) == full and bool((draft.vocab == torch.arange(full)).all())
             else draft.vocab.tolist())
    save_weights(draft, path, EAGLE_FORMAT, {"hidden_size": str(draft.fuse.weight.shape[0]), "vocab_size": str(full),
                                             "vocab": json.dumps(vocab), "info": json.dumps(info)})


def load_draft(lm: LM, path: str | Path, check_base: bool = True, dtype: str | None = None):
    """Our draft file, or a published EAGLE-1/2 or EAGLE-3 checkpoint (a directory or a hub id); its
    own weights in `dtype` (decoder.draft_dtype; None: the target's)."""
    if is_checkpoint_dir(path):
        from .published import load_eagle

        draft = load_eagle(lm, path, check_base)
    else:
        meta, state, info = load_checked(
            lm, path, EAGLE_FORMAT, "decoder.draft_weights", "EAGLE draft file",
            "train one with scripts/train_eagle.py or set decoder.draft_weights=null for an untrained draft",
            check_base=check_base)
        where = addon_path(path)
        vocab = meta_json(meta, "vocab", "decoder.draft_weights", where, "null")
        if vocab is not None and not (isinstance(vocab, list) and all(isinstance(t, int) for t in vocab)):
            raise ValueError(f"decoder.draft_weights: {where} has metadata vocab that is not a list of token ids; "
                             "replace the file")
        draft = new_draft(lm, vocab)
        load_state(draft, {k: v.to(draft.fuse.weight.dtype) for k, v in state.items()}, "decoder.draft_weights",
                   where, "an EAGLE draft of this target's shape")
        draft.info = info
    return _ready(lm, draft, dtype)


def draft_for(lm: LM, path: str | None, seed: int | None, check_base: bool = True, dtype: str | None = None):
    """The draft at `path` (our file or a published checkpoint), or an untrained (seed: random) draft
    without one; its own weights in `dtype` (decoder.draft_dtype; None: the target's)."""
    return load_draft(lm, path, check_base, dtype) if path else _ready(lm, new_draft(lm, seed=seed), dtype)


def _ready(lm: LM, draft: nn.Module, dtype: str | None) -> nn.Module:
    """In its dtype, then on the target's fast path."""
    if dtype is not None and DRAFT_DTYPES[dtype] != draft.dtype:
        draft_in_dtype(draft, DRAFT_DTYPES[dtype])
    lm.accelerate(draft.readout)
    return lm.accelerate(draft)


DRAFT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draft_in_dtype(draft: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The draft's own weights in `dtype`, its reduced readout (a copy of the head's rows) included;
    what it reads from the target (the embedding, the final norm, a whole-vocabulary head it shares)
    stays in the target's dtype, and the draft casts at those seams. Every layer it runs reads half
    the bytes in bfloat16: on a CPU the draft's cost is the time to read its weights."""
    draft.to(dtype=dtype)
    readout, head = draft.readout, draft.target.lm.model.get_output_embeddings()
    if readout is not head and readout.weight is not head.weight:
        readout.to(dtype=dtype)
    return draft


@dataclass
class DraftNodes:
    """One proposal's drafted nodes in the order they were made (node 0: the root), as columns."""

    token: list[int]
    parent: list[int]  # -1 for the root
    depth: list[int]
    score: list[float]  # cumulative log-probability under the draft


class FeatureDraftProposer:
    """The proposer: drafts a tree in feature space, verified by the loop in one target pass."""

    waits_for_prefill = True  # the draft reads the target's features of the prompt first
    hidden = False

    def __init__(self, draft: FeatureDraft, tree: str, tree_size: int, depth: int, top_k: int,
                 template: RankTree | None = None):
        self.draft, self.kind, self.tree_size, self.depth, self.top_k = draft, tree, tree_size, depth, top_k
        self.template = template  # static: the tree whose slots the draft's ranks fill
        self.feature_layers = draft.reads  # what every pass returns: the features the draft reads
        self.cache = KVCache(DynamicCache())
        self.pending: tuple[torch.Tensor, list[int]] | None = None  # committed rows not yet fed to the draft
        # One proposal's drafting state (_draft): tokens fed and FLOPs; the nodes (token, parent, depth,
        # cumulative log-probability); each fed node's predicted features and its draft cache slot.
        self.forward_tokens, self.flops = 0, 0.0
        self.prune = True  # on a CPU, feed no frontier node that can no longer reach the tree (_dynamic)
        self._vocab: torch.Tensor | None = None  # the draft vocabulary on the draft's device
        self.nodes = DraftNodes([], [], [], [])
        self.node_features: dict[int, torch.Tensor] = {}
        self.slot: dict[int, int] = {}

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        with torch.inference_mode():
            tree = self._draft(sequence, room)
        return Proposal(tree, feature_layers=self.feature_layers, draft_forward_tokens=self.forward_tokens,
                        draft_flops=self.flops)

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        # The committed positions scored this step (the uncached tokens, then the accepted nodes), each
        # with the token that follows it: the draft's next inputs. (When the output ended mid-path, the
        # loop stops and these are never read.)
        u = scores.features.shape[0] - len(proposal.tree) + 1
        rows = list(range(u)) + [u - 1 + i for i in path[1:]]
        self.pending = (scores.features[rows], list(sequence[-len(rows):]))
        tree = proposal.tree
        return {"draft_depth": max(tree.depths), "accepted_depth": len(path) - 1, "tree_size": len(tree)}

    # ---- drafting -----------------------------------------------------------------------------------
    def _feed(self, features, tokens, positions, mask) -> torch.Tensor:
        context = len(self.cache)
        out = self.draft(features, torch.as_tensor(tokens, dtype=torch.long, device=features.device),
                         torch.as_tensor(positions, dtype=torch.long), mask, self.cache)
        self.forward_tokens += len(tokens)
        self.flops += self.draft.flops(len(tokens), context, len(tokens))
        return out

    def _draft(self, sequence: Sequence[int], room: int) -> TokenTree:
        self.forward_tokens, self.flops = 0, 0.0  # counted by _feed
        feats, tokens = self.pending
        self.pending = None
        base = len(self.cache)
        n = len(tokens)
        # The committed rows, causally; the last one (the root's input) predicts the root's features.
        mask = causal_mask(n, base)
        dtype = self.draft.dtype  # from_target may apply the target's norm, in the target's dtype
        root_g = self._feed(self.draft.from_target(feats.to(dtype)).to(dtype), tokens, range(base, base + n), mask)[-1]
        base += n
        if base != len(sequence) - 1:
            raise RuntimeError(f"EAGLE draft cache holds {base} positions, expected {len(sequence) - 1}")
        depth = min(self.depth, room)
        root = int(sequence[-1])
        if depth <= 0 or self.tree_size <= 0:
            return TokenTree.chain(root, [])
        # Nodes: token, parent, depth, cumulative log-probability; features and cache slot once fed.
        self.nodes = DraftNodes(token=[root], parent=[-1], depth=[0], score=[0.0])
        self.node_features, self.slot = {0: root_g}, {}
        try:
            if self.kind == "dynamic":
                chosen = self._dynamic(base, depth)
            else:
                chosen = self._static(base, depth)
        finally:
            self.cache.crop(base)
        nodes = self.nodes
        order = [0] + sorted(chosen, key=lambda i: (nodes.depth[i], i))  # parents first
        index = {node: i for i, node in enumerate(order)}
        return TokenTree([nodes.token[i] for i in order], [-1] + [index[nodes.parent[i]] for i in order[1:]])

    def _vocab_on(self, device: torch.device) -> torch.Tensor:
        """The draft vocabulary (draft id -> token id) on `device`: copied once, not per step."""
        if self._vocab is None or self._vocab.device != device:
            self._vocab = self.draft.vocab.to(device)
        return self._vocab

    def _expand(self, base: int, frontier: list[int], token: torch.Tensor) -> torch.Tensor:
        """Feed `frontier` (nodes of one depth; `token`: every node's token, on the draft's device) to the
        draft; returns their children's log-probabilities over the draft vocabulary. The root's children
        come from the root's features, fed already."""
        if frontier == [0]:
            g = self.node_features[0][None]
        else:
            nodes, context = self.nodes, len(self.cache)
            mask = level_mask(context, base, [[self.slot[a] for a in ancestors(nodes.parent, node)]
                                              for node in frontier])
            parents = [nodes.parent[x] for x in frontier]
            g = self._feed(torch.stack([self.node_features[p] for p in parents]),
                           token[torch.tensor(frontier, device=token.device)],
                           [base - 1 + nodes.depth[x] for x in frontier], mask)
            for row, node in enumerate(frontier):
                self.node_features[node], self.slot[node] = g[row], context + row
        return torch.log_softmax(self.draft.logits(g).float(), dim=-1)

    def _dynamic(self, base: int, depth: int) -> list[int]:
        """EAGLE-2's tree, built on the draft's device: each depth expands the frontier (the top_k
        newest nodes by cumulative log-probability), top_k children each; the tree is the tree_size
        best nodes (ties: shallower, then older, first). Nothing goes to the host until the tree is
        built (the authors' code neither), except on a CPU, where a frontier node that can no longer
        reach the tree is not fed (`prune`: a child scores at most its parent, is deeper than every
        candidate so far and loses ties by depth, so the tree stays the same with fewer rows fed)."""
        g = self.node_features[0][None]  # (1, d): the root's predicted features
        device = g.device
        k = min(self.top_k, len(self.draft.vocab))
        vocab = self._vocab_on(device)
        token = torch.tensor([self.nodes.token[0]], device=device)  # (N,) every node so far
        parent = torch.tensor([-1], device=device)
        depth_of = torch.zeros(1, dtype=torch.long, device=device)
        score = torch.zeros(1, device=device)
        frontier = torch.zeros(1, dtype=torch.long, device=device)  # (F,) nodes to expand
        ancestry = torch.zeros(1, 0, dtype=torch.bool, device=device)  # (F, S): frontier rows' fed ancestors
        parent_g = g  # (F, d): the frontier's parents' predicted features
        fed_levels = []  # (frontier, its predicted features) per depth fed
        prune = self.prune and device.type == "cpu"
        for d in range(1, depth + 1):
            if d > 1:  # feed the frontier: its tokens, after its parents' features; one new cache row each
                f = len(frontier)
                rows = torch.cat([torch.ones(f, base, dtype=torch.bool, device=device), ancestry,
                                  torch.eye(f, dtype=torch.bool, device=device)], 1)  # (F, cache + F)
                g = self._feed(parent_g, token[frontier], base - 1 + depth_of[frontier], rows)  # (F, d)
                ancestry = rows[:, base:]
                fed_levels.append((frontier, g))
            logp = torch.log_softmax(self.draft.logits(g).float(), dim=-1)  # (F, V')
            top, idx = logp.topk(k, dim=-1)  # (F, k)
            n = len(token)
            token = torch.cat([token, vocab[idx].flatten()])
            parent = torch.cat([parent, frontier.repeat_interleave(k)])
            depth_of = torch.cat([depth_of, torch.full((len(frontier) * k,), d, device=device)])
            score = torch.cat([score, (score[frontier][:, None] + top).flatten()])
            if d == depth:
                break
            best = torch.sort(-score[n:], stable=True).indices[:k]  # (k,) the newest nodes' best, oldest first
            if prune and len(score) - 1 >= self.tree_size:
                bar = score[1:].topk(self.tree_size).values[-1]
                best = best[score[n + best] > bar]
                if len(best) == 0:
                    break
            parent_g, ancestry = g[best // k], ancestry[best // k]
            frontier = n + best
        chosen = torch.sort(-score[1:], stable=True).indices[:self.tree_size] + 1  # ties: the older (shallower)
        self.nodes = DraftNodes(token=token.tolist(), parent=parent.tolist(), depth=depth_of.tolist(),
                                score=score.tolist())
        for nodes, features in fed_levels:  # what each fed node predicted (read by tests: a fresh run along its path)
            self.node_features.update(zip(nodes.tolist(), features))
        return chosen.tolist()

    def _static(self, base: int, depth: int) -> list[int]:
        """EAGLE-1's tree: the template's nodes, each its template parent's rank-r child. Where each
        node goes is the template's, known here; only tokens and scores come from the draft, and they
        stay on its device until the tree is built."""
        parents, slots = self.template
        keep = [i for i in range(1, len(parents)) if slots[i - 1][0] < depth]
        placed = {0: 0}  # template node -> node
        has_children = {parents[i] for i in keep}
        nodes = self.nodes  # parent and depth: host lists (the template's); token and score: device tensors
        device = self.node_features[0].device
        vocab = self._vocab_on(device)
        token, score = torch.tensor(nodes.token, device=device), torch.zeros(1, device=device)  # (N,)
        level = [0]
        for d in range(1, depth + 1):
            ask = [t for t in level if t in has_children]
            if not ask:
                break
            logp = self._expand(base, [placed[t] for t in ask], token)  # (F, V')
            width = min(max(slots[i - 1][1] for i in keep if parents[i] in ask) + 1, logp.shape[-1])
            top, idx = logp.topk(width, dim=-1)  # (F, width)
            row = {t: r for r, t in enumerate(ask)}
            level = [i for i in keep if slots[i - 1][0] == d - 1 and parents[i] in row and slots[i - 1][1] < width]
            if not level:
                break
            rows = torch.tensor([row[parents[i]] for i in level], device=device)
            ranks = torch.tensor([slots[i - 1][1] for i in level], device=device)
            above = [placed[parents[i]] for i in level]
            token = torch.cat([token, vocab[idx[rows, ranks]]])
            score = torch.cat([score, score[above] + top[rows, ranks]])
            for i, parent in zip(level, above):
                placed[i] = len(nodes.parent)
                nodes.parent.append(parent)
                nodes.depth.append(nodes.depth[parent] + 1)
        nodes.token, nodes.score = token.tolist(), score.tolist()
        return [placed[i] for i in keep if i in placed]


@dataclass
class Eagle:
    # ours, or an EAGLE-1/2/3 dir or hub id; null = untrained
    draft_weights: str | None = "adapters/smollm2-135m-eagle.safetensors"
    draft_seed: int | None = None  # draft_weights=null: a random draft from this seed (exactness tests)
    tree: Any = "dynamic"  # dynamic (EAGLE-2) | static (EAGLE-1) | mc_sim_7b_63 (EAGLE-1's own) | rank paths
    tree_size: int = 24  # draft nodes verified (verification width - 1)
    depth: int = 6  # deepest draft node
    top_k: int = 8  # dynamic: nodes expanded per depth and children per node; static: ranks per depth
    check_base: bool = True  # refuse a draft made for another base model (by the name its file records)
    draft_dtype: str | None = None  # the draft's own weights: None = the target's dtype, or one of DRAFT_DTYPES
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    _draft: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)

    def __post_init__(self):
        for key in ("tree_size", "depth", "top_k"):
            check(key, getattr(self, key), at_least=1)
        self._given = None if self.tree in ("dynamic", "static") else given_paths("tree", self.tree, "eagle")
        if self.tree not in ("dynamic", "static") and self._given is None:
            raise ValueError("decoder.tree must be dynamic, static, a tree its authors published ("
                             f"{', '.join(published_trees()['eagle'])}) or a list of rank paths, got {self.tree!r}")
        check("draft_dtype", self.draft_dtype, one_of=tuple(DRAFT_DTYPES), also=(None,))
        size = len(self._given) if self._given is not None else self.tree_size
        self.widest_step = check_step(1 + size, f"1 + tree size {size}")
        self.lossless = True
        self.tuning: dict = {}
        self._static_tree = None  # (draft, the static tree built for it, its source)

    def load_addons(self, lm: LM) -> FeatureDraft:
        """The draft, built before any timing (a bad file fails in one line)."""
        return self._draft.get(lm, lambda: draft_for(lm, self.draft_weights, self.draft_seed, self.check_base,
                                                      self.draft_dtype))

    def static_tree_for(self, draft: FeatureDraft) -> tuple[FeatureDraft, RankTree, str]:
        """The static tree: given, or from the draft's measured accuracy, or the prior; and its source."""
        if self._given is not None:  # the authors' tree, or one given: tree_size / depth / top_k do not apply
            return draft, rank_tree(self._given, "tree"), "published" if isinstance(self.tree, str) else "given"
        if self._static_tree is None or self._static_tree[0] is not draft:
            measured = draft.accuracy()
            accuracy = [row[:self.top_k] for row in measured[:self.depth]] if measured else None
            accuracy = accuracy or prior_accuracy(self.depth, self.top_k)
            tree = rank_tree(best_paths(accuracy, self.tree_size, self.top_k))
            self._static_tree = (draft, tree, "measured" if measured else "prior")
        return self._static_tree

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        draft = self.load_addons(lm)
        template = None
        kind, depth = ("dynamic" if self.tree == "dynamic" else "static"), self.depth
        self.tuning = {"tree": self.tree if isinstance(self.tree, str) else "list", "tree_size": self.tree_size,
                       "depth": self.depth, "top_k": self.top_k,
                       "draft_vocab": len(draft.vocab), "draft_dtype": str(draft.dtype).replace("torch.", "")}
        if kind == "static":
            _, template, source = self.static_tree_for(draft)
            depth = max((d + 1 for d, _ in template.slots), default=0)  # a given tree's own: it may pass self.depth
            self.tuning.update(source=source, tree_size=len(template.parents) - 1, depth=depth)
        return FeatureDraftProposer(draft, kind, self.tree_size, depth, self.top_k, template), None

    generate = decode_one  # one prompt through the shared loop
