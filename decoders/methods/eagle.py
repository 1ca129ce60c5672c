"""EAGLE (Li et al. 2024; EAGLE-2, Li et al. 2024b): the proposer and the method's settings.

The draft (eagle_draft.py: ours, or a published EAGLE-1/2/3 checkpoint) predicts the target's next
features from its features and the next token. The proposer drafts autoregressively in feature
space: a drafted node's input is its parent's predicted features and its own token. It keeps the
draft's KV cache of committed positions (real features); tree nodes are appended while drafting
and cropped before the target verifies.

Trees (`tree`):
- dynamic (EAGLE-2): the root's `top_k` best tokens; at each further depth the `top_k` nodes of
  the last depth with the highest cumulative draft log-probability are expanded, `top_k`
  children each; finally the `tree_size` nodes of highest cumulative log-probability are
  verified (closed under prefixes: a child never scores above its parent).
- static (EAGLE-1): a fixed tree of rank paths, the `tree_size` paths of depth <= `depth` most
  likely under the draft's per-depth rank accuracy measured at training (stored in the file;
  a generic prior without one).

`tree_size=auto` sizes either tree for this device, as Medusa's does (tuning/tree_size.py): of
`auto_sizes`, the size whose static tree forecasts the most tokens per unit of time, a step costing
a forward of size + 1 tokens (the cached latency profile) plus one drafting depth of `top_k` rows
(eagle_draft.depth_seconds, timed at load) per depth of that tree; the depth drafted is that tree's.

Candidates are deterministic (top-k), so greedy is exact and sampling uses
deterministic-candidate acceptance, which keeps the target's distribution; verification does not
depend on the draft vocabulary.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from ..core.contract import PerTarget, check, check_step, decode_one
from ..core.kv_cache import KVCache, causal_mask, level_mask
from ..core.lm import LM
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler
from ..core import transfer
from ..core.transfer import to_device
from ..core.tree import (DeviceTree, RankTree, TokenTree, ancestors, best_paths, given_paths, prior_accuracy,
                         published_trees, rank_tree)
from ..tuning.profile import forward_latency, step_cost
from ..tuning.tree_size import check_sizes, choose_size
from .eagle_draft import DRAFT_DTYPES, FeatureDraft, depth_seconds, draft_for

_ROOT = torch.zeros(1, dtype=torch.long)  # the root's node index, as FeatureDraftProposer.fed lists nodes


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
        self.forward_tokens, self.flops, self.forwards = 0, 0.0, 0
        self.prune = True  # where reads do not wait (a CPU), feed no frontier node that cannot reach the tree
        self._vocab: torch.Tensor | None = None  # the draft vocabulary on the draft's device
        self.nodes = DraftNodes([], [], [], [])
        self.fed: list[tuple[torch.Tensor, torch.Tensor]] = []  # per depth fed: nodes (F,), predicted features (F, d)
        self._plans: dict[tuple, StaticPlan] = {}  # static: the template's plan per (depth, vocabulary, device)

    @property
    def node_features(self) -> dict[int, torch.Tensor]:
        """What each node fed this proposal predicted (node 0: the root), gathered only when asked."""
        return {node: g for nodes, feats in self.fed for node, g in zip(nodes.tolist(), feats)}

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
        features = scores.features.index_select(0, to_device(rows, scores.features.device, torch.long))
        self.pending = (features, list(sequence[-len(rows):]))
        tree = proposal.tree
        return {"draft_depth": max(tree.depths), "accepted_depth": len(path) - 1, "tree_size": len(tree),
                "draft_forwards": self.forwards}

    # ---- drafting -----------------------------------------------------------------------------------
    def _feed(self, features, tokens, positions, mask) -> torch.Tensor:
        context = len(self.cache)
        out = self.draft(features, to_device(tokens, features.device, torch.long),
                         to_device(positions, features.device, torch.long), mask, self.cache)
        self.forward_tokens += len(tokens)
        self.flops += self.draft.flops(len(tokens), context, len(tokens))
        self.forwards += 1
        return out

    def _draft(self, sequence: Sequence[int], room: int) -> TokenTree | DeviceTree:
        self.forward_tokens, self.flops, self.forwards = 0, 0.0, 0  # counted by _feed
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
        self.fed = [(_ROOT, root_g[None])]
        try:
            drafted = self._dynamic(base, depth) if self.kind == "dynamic" else self._static(base, depth)
        finally:
            self.cache.crop(base)
        return self._tree(*drafted, root, depth)

    def _vocab_on(self, device: torch.device) -> torch.Tensor:
        """The draft vocabulary (draft id -> token id) on `device`: copied once, not per step."""
        if self._vocab is None or self._vocab.device != device:
            self._vocab = self.draft.vocab.to(device)
        return self._vocab

    def _dynamic(self, base: int, depth: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """EAGLE-2's tree, built on the draft's device: each depth expands the frontier (the top_k
        newest nodes by cumulative log-probability), top_k children each; the tree is the tree_size
        best nodes (ties: shallower, then older, first). Nothing goes to the host while drafting (the
        authors' code reads the tree once built; here a GPU reads it with verification, _tree), except
        where reads do not wait (a CPU): there a frontier node that can no longer reach the tree is not
        fed (`prune`: a child scores at most its parent, is deeper than every candidate so far and
        loses ties by depth, so the tree stays the same with fewer rows fed)."""
        g = self.fed[0][1]  # (1, d): the root's predicted features
        device = g.device
        k = min(self.top_k, len(self.draft.vocab))
        vocab = self._vocab_on(device)
        token = to_device([self.nodes.token[0]], device)  # (N,) every node so far
        parent = torch.full((1,), -1, device=device)
        depth_of = torch.zeros(1, dtype=torch.long, device=device)
        score = torch.zeros(1, device=device)
        frontier = torch.zeros(1, dtype=torch.long, device=device)  # (F,) nodes to expand
        ancestry = torch.zeros(1, 0, dtype=torch.bool, device=device)  # (F, S): frontier rows' fed ancestors
        parent_g = g  # (F, d): the frontier's parents' predicted features
        prune = self.prune and not transfer.reads_wait(device)
        for d in range(1, depth + 1):
            if d > 1:  # feed the frontier: its tokens, after its parents' features; one new cache row each
                f = len(frontier)
                rows = torch.cat([torch.ones(f, base, dtype=torch.bool, device=device), ancestry,
                                  torch.eye(f, dtype=torch.bool, device=device)], 1)  # (F, cache + F)
                g = self._feed(parent_g, token.index_select(0, frontier),
                               torch.full((f,), base + d - 2, device=device), rows)  # (F, d): all at depth d - 1
                ancestry = rows[:, base:]
                self.fed.append((frontier, g))
            logp = torch.log_softmax(self.draft.logits(g).float(), dim=-1)  # (F, V')
            top, idx = logp.topk(k, dim=-1)  # (F, k)
            n = len(token)
            token = torch.cat([token, vocab.index_select(0, idx.view(-1))])
            parent = torch.cat([parent, frontier.repeat_interleave(k)])
            depth_of = torch.cat([depth_of, torch.full((len(frontier) * k,), d, device=device)])
            score = torch.cat([score, (score.index_select(0, frontier)[:, None] + top).view(-1)])
            if d == depth:
                break
            best = torch.sort(-score[n:], stable=True).indices[:k]  # (k,) the newest nodes' best, oldest first
            if prune and len(score) - 1 >= self.tree_size:
                bar = score[1:].topk(self.tree_size).values[-1]
                best = best[score.index_select(0, n + best) > bar]
                if len(best) == 0:
                    break
            rows = best // k  # (k,) each best node's frontier row
            parent_g, ancestry = g.index_select(0, rows), ancestry.index_select(0, rows)
            frontier = n + best
        chosen = torch.sort(-score[1:], stable=True).indices[:self.tree_size] + 1  # ties: the older (shallower)
        return token, score, (parent, depth_of, chosen)

    def _tree(self, token: torch.Tensor, score: torch.Tensor, shape: "tuple | StaticPlan", root: int,
              height: int) -> TokenTree | DeviceTree:
        """The tree verified: the root, then the chosen nodes parents first (by depth, then as drafted).
        Every node drafted is (N,) `token` and `score` on the device; `shape` is EAGLE-2's dynamic one,
        there too ((N,) parent and depth, (m,) chosen), or the static plan, whose tree is known. Where a
        read makes the host wait, the tree stays on the device and is read with verification's argmax;
        elsewhere it is read now. Either way one read: float64 holds every id and float32 score exactly."""
        n_all = len(token)
        if isinstance(shape, StaticPlan):
            nodes, tree_parents, tree_depths = shape.tree_nodes, shape.tree_parents, shape.tree_depths
            read = torch.cat([token.double(), score.double()])

            def settle(values: list[float]) -> TokenTree:
                ids = [int(v) for v in values[:n_all]]
                self.nodes = DraftNodes(token=ids, parent=list(shape.parent), depth=list(shape.depth),
                                        score=values[n_all:])
                return TokenTree([ids[i] for i in shape.tree], list(tree_parents))
        else:  # the shape is the device's: order and renumber there
            parent, depth_of, chosen = shape
            order = chosen.index_select(0, torch.argsort(depth_of.index_select(0, chosen) * n_all + chosen))  # (m,)
            nodes = torch.cat([torch.zeros(1, dtype=torch.long, device=token.device), order])  # (n,)
            renumber = torch.full_like(token, -1).index_copy_(0, nodes, torch.arange(len(nodes), device=token.device))
            tree_parents = renumber.index_select(0, parent.index_select(0, nodes).clamp(min=0))  # (n,)
            tree_parents[0] = -1
            tree_depths, n = depth_of.index_select(0, nodes), len(nodes)
            read = torch.cat([t.double() for t in (token.index_select(0, nodes), tree_parents, token, parent,
                                                   depth_of, score)])

            def settle(values: list[float]) -> TokenTree:
                ids = [int(v) for v in values[:2 * n + 3 * n_all]]
                self.nodes = DraftNodes(token=ids[2 * n:2 * n + n_all], parent=ids[2 * n + n_all:2 * n + 2 * n_all],
                                        depth=ids[2 * n + 2 * n_all:], score=values[2 * n + 3 * n_all:])
                return TokenTree(ids[:n], ids[n:2 * n])
        if not transfer.reads_wait(token.device):
            return settle(read.tolist())
        return DeviceTree(root, token.index_select(0, nodes), tree_parents, tree_depths, height, read, settle)

    def _static(self, base: int, depth: int) -> tuple[torch.Tensor, torch.Tensor, "StaticPlan"]:
        """EAGLE-1's tree: the template's nodes, each its template parent's rank-r child. Where each node
        goes, what each depth feeds and its mask are the plan's (made once per depth); only tokens and
        scores come from the draft, and they stay on its device until the tree is built."""
        g = self.fed[0][1]  # (1, d): the root's predicted features
        device = g.device
        vocab = self._vocab_on(device)
        key = (depth, len(vocab), device)
        if key not in self._plans:
            self._plans[key] = static_plan(self.template, depth, len(vocab), device)
        plan = self._plans[key]
        token, score = to_device(self.nodes.token, device), torch.zeros(1, device=device)  # (N,)
        for level in plan.levels:
            if level.tail is not None:  # feed the frontier: its tokens after its parents' features
                f = len(level.frontier)
                mask = torch.cat([torch.ones(f, base, dtype=torch.bool, device=device), level.tail], 1)  # (F, cache+F)
                g = self._feed(g.index_select(0, level.parent_rows), token.index_select(0, level.frontier),
                               torch.full((f,), base + level.depth - 1, device=device), mask)
                self.fed.append((level.frontier, g))
            logp = torch.log_softmax(self.draft.logits(g).float(), dim=-1)  # (F, V')
            top, idx = logp.topk(level.width, dim=-1)  # (F, width)
            # index_select on flat indices: a 2-D advanced index costs several times more, five times a step
            token = torch.cat([token, vocab.index_select(0, idx.view(-1).index_select(0, level.picked))])
            score = torch.cat([score, score.index_select(0, level.above) + top.view(-1).index_select(0, level.picked)])
        return token, score, plan


@dataclass(frozen=True)
class PlanLevel:
    """One depth of a static tree's drafting: the frontier fed (placed nodes, all at `depth`) and the
    children it places. Its tensors are on the draft's device: drafting copies nothing from the host."""

    depth: int  # the frontier's depth (0: the root, fed already: tail None)
    frontier: torch.Tensor  # (F,) placed nodes
    parent_rows: torch.Tensor  # (F,) each frontier node's parent's row in the previous level's features
    tail: torch.Tensor | None  # (F, fed before + F) bool: the tree rows already fed that each row sees, and itself
    width: int  # ranks read per frontier row
    picked: torch.Tensor  # (C,) each child's (frontier row, rank) in the (F, width) top-k, flattened
    above: torch.Tensor  # (C,) each child's parent, placed


@dataclass(frozen=True)
class StaticPlan:
    levels: tuple[PlanLevel, ...]
    parent: tuple[int, ...]  # per placed node (node 0: the root)
    depth: tuple[int, ...]
    # The tree verified: the placed nodes of the template within the depth, the root first, parents first
    # (by depth, then as placed); its parents and depths in that numbering; the nodes again on the device
    tree: tuple[int, ...]
    tree_parents: tuple[int, ...]
    tree_depths: tuple[int, ...]
    tree_nodes: torch.Tensor


def static_plan(template: RankTree, depth: int, vocab: int, device: torch.device) -> StaticPlan:
    """What drafting a static tree does at each depth, worked out once (the authors' code prepares
    its tree's indices the same way, once): placing a template node depends only on the template,
    the depth and the draft vocabulary's size, never on the tokens drafted."""
    parents, slots = template
    keep = [i for i in range(1, len(parents)) if slots[i - 1][0] < depth]
    has_children = {parents[i] for i in keep}
    placed = {0: 0}  # template node -> placed node
    parent, depth_of, slot = [-1], [0], {}  # placed nodes' parents and depths; fed nodes' draft cache slots
    levels, level, previous, fed = [], [0], [0], 0  # previous: the last frontier (template nodes)
    for d in range(1, depth + 1):
        ask = [t for t in level if t in has_children]
        if not ask:
            break
        frontier = [placed[t] for t in ask]
        width = min(max(slots[i - 1][1] for i in keep if parents[i] in ask) + 1, vocab)
        row = {t: r for r, t in enumerate(ask)}
        level = [i for i in keep if slots[i - 1][0] == d - 1 and parents[i] in row and slots[i - 1][1] < width]
        if not level:  # every rank asked for lies past the draft vocabulary: nothing to feed or place
            break
        tail = None
        if d > 1:  # the root's children come from its features, fed already
            # over the tree rows fed so far (after the committed text): each row sees its ancestors and itself
            tail = level_mask(fed, 0, [[slot[a] for a in ancestors(parent, node)] for node in frontier]).to(device)
            slot.update((node, fed + r) for r, node in enumerate(frontier))
            fed += len(frontier)
        at = {t: r for r, t in enumerate(previous)}
        levels.append(PlanLevel(
            depth=d - 1, frontier=torch.tensor(frontier, device=device),
            parent_rows=torch.tensor([at[parents[t]] if t else 0 for t in ask], device=device), tail=tail,
            width=width, picked=torch.tensor([row[parents[i]] * width + slots[i - 1][1] for i in level],
                                             dtype=torch.long, device=device),
            above=torch.tensor([placed[parents[i]] for i in level], dtype=torch.long, device=device)))
        for i in level:
            placed[i] = len(parent)
            parent.append(placed[parents[i]])
            depth_of.append(d)
        previous = ask
    tree = [0] + sorted((placed[i] for i in keep if i in placed), key=lambda node: (depth_of[node], node))
    renumber = {node: i for i, node in enumerate(tree)}
    tree_parents = tuple([-1] + [renumber[parent[node]] for node in tree[1:]])
    return StaticPlan(tuple(levels), tuple(parent), tuple(depth_of), tuple(tree), tree_parents,
                      tuple(depth_of[node] for node in tree), torch.tensor(tree, device=device))


@dataclass
class Eagle:
    # ours, or an EAGLE-1/2/3 dir or hub id; null = untrained
    draft_weights: str | None = "adapters/smollm2-135m-eagle.safetensors"
    draft_seed: int | None = None  # draft_weights=null: a random draft from this seed (exactness tests)
    tree: Any = "dynamic"  # dynamic (EAGLE-2) | static (EAGLE-1) | mc_sim_7b_63 (EAGLE-1's own) | rank paths
    tree_size: Any = 24  # draft nodes verified (verification width - 1); auto: of auto_sizes, the best on this device
    depth: int = 6  # deepest draft node (auto: the deepest it may choose)
    auto_sizes: list = field(default_factory=lambda: [4, 8, 12, 16, 24, 32, 48])
    cache_dir: str | None = None  # where tree_size=auto finds (or keeps) this device's latency profile
    top_k: int = 8  # dynamic: nodes expanded per depth and children per node; static: ranks per depth
    check_base: bool = True  # refuse a draft made for another base model (by the name its file records)
    draft_dtype: str | None = None  # the draft's own weights: None = the target's dtype, or one of DRAFT_DTYPES
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    _draft: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)
    target_needs = {"features": "its draft reads them", "weights": "its draft reads the target's embedding and head"}

    def __post_init__(self):
        for key in ("depth", "top_k"):
            check(key, getattr(self, key), at_least=1)
        widest = check_sizes(self.tree_size, self.auto_sizes)
        self._given = None if self.tree in ("dynamic", "static") else given_paths("tree", self.tree, "eagle")
        if self.tree not in ("dynamic", "static") and self._given is None:
            raise ValueError("decoder.tree must be dynamic, static, a tree its authors published ("
                             f"{', '.join(published_trees()['eagle'])}) or a list of rank paths, got {self.tree!r}")
        check("draft_dtype", self.draft_dtype, one_of=tuple(DRAFT_DTYPES), also=(None,))
        size = len(self._given) if self._given is not None else widest
        self.widest_step = check_step(1 + size, f"1 + tree size {size}")
        self.lossless = True
        self.tuning: dict = {}
        self._static_tree = None  # (draft, size, depth, the static tree built for them, its source)
        self._sized = None  # tree_size=auto: (draft, size, depth, what auto reports)

    def load_addons(self, lm: LM) -> FeatureDraft:
        """The draft, built before any timing (a bad file fails in one line)."""
        return self._draft.get(lm, lambda: draft_for(lm, self.draft_weights, self.draft_seed, self.check_base,
                                                      self.draft_dtype))

    def accuracy(self, draft: FeatureDraft) -> tuple[list[list[float]], str]:
        """acc[j][r] for depths <= `depth` and ranks < `top_k`: the draft's measured, else the prior."""
        measured = draft.accuracy()
        accuracy = [row[:self.top_k] for row in measured[:self.depth]] if measured else None
        return (accuracy, "measured") if accuracy else (prior_accuracy(self.depth, self.top_k), "prior")

    def sized(self, lm: LM, draft: FeatureDraft) -> tuple[int, int]:
        """(tree_size, depth): as configured, or tree_size=auto's choice for this device (made once per draft)."""
        if self.tree_size != "auto":
            return self.tree_size, self.depth
        if self._sized is None or self._sized[0] is not draft:
            profile = forward_latency(lm, self.cache_dir, max_tokens=max(self.auto_sizes) + 1)
            depth_cost = depth_seconds(lm, draft, self.top_k, 64, [self.top_k], 5)[0] / profile["autoregressive_s"]
            size, info, _ = choose_size(self.accuracy(draft)[0], self.top_k, self.auto_sizes,
                                        functools.partial(step_cost, profile), lambda depth: depth * depth_cost)
            self._sized = (draft, size, info["depth"], {**info, "depth_cost": depth_cost})
        return self._sized[1], self._sized[2]

    def static_tree_for(self, draft: FeatureDraft, size: int, depth: int) -> tuple[RankTree, str]:
        """The static tree: given, or from the draft's measured accuracy, or the prior; and its source."""
        if self._given is not None:  # the authors' tree, or one given: tree_size / depth / top_k do not apply
            return rank_tree(self._given, "tree"), "published" if isinstance(self.tree, str) else "given"
        if self._static_tree is None or self._static_tree[:3] != (draft, size, depth):
            accuracy, source = self.accuracy(draft)
            tree = rank_tree(best_paths(accuracy[:depth], size, self.top_k))
            self._static_tree = (draft, size, depth, tree, source)
        return self._static_tree[3:]

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        draft = self.load_addons(lm)
        template = None
        kind = "dynamic" if self.tree == "dynamic" else "static"
        size, depth = self.sized(lm, draft)
        self.tuning = {"tree": self.tree if isinstance(self.tree, str) else "list", "tree_size": size,
                       "depth": depth, "top_k": self.top_k,
                       "draft_vocab": len(draft.vocab), "draft_dtype": str(draft.dtype).replace("torch.", "")}
        if self.tree_size == "auto":
            self.tuning.update(auto=True, **self._sized[3])
        if kind == "static":
            template, source = self.static_tree_for(draft, size, depth)
            depth = max((d + 1 for d, _ in template.slots), default=0)  # a given tree's own: it may pass self.depth
            self.tuning.update(source=source, tree_size=len(template.parents) - 1, depth=depth)
        return FeatureDraftProposer(draft, kind, size, depth, self.top_k, template), None

    generate = decode_one  # one prompt through the shared loop
