"""Token trees: the candidates a target verifies in one forward pass.

Node 0 is the root: the last committed token, not yet in the KV cache. Every other node
has a parent with a smaller index, so a chain of k drafts is the tree with parents
[-1, 0, 1, ..., k-1].
"""
from __future__ import annotations

import functools
import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from . import transfer
from .transfer import to_device


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(init=False)
    children: list[list[int]] = field(init=False)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents) or not self.tokens:
            raise ValueError("a token tree needs one parent per token and at least the root")
        if self.parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        self.depths = [0] * len(self.tokens)
        self.children = [[] for _ in self.tokens]
        for i, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must precede their children")
            self.depths[i] = self.depths[parent] + 1
            self.children[parent].append(i)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> "TokenTree":
        return cls([root, *drafts], list(range(-1, len(drafts))))

    @classmethod
    def from_sequences(cls, root: int, sequences: Sequence[Sequence[int]]) -> "TokenTree":
        """Merge candidate continuations of `root` into a trie (shared prefixes verified once)."""
        tokens, parents = [root], [-1]
        index: dict[tuple[int, int], int] = {}
        for seq in sequences:
            node = 0
            for tok in seq:
                key = (node, int(tok))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                node = index[key]
        return cls(tokens, parents)

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        out = []
        while node != -1:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def is_chain(self) -> bool:
        """Every node the child of the one before it (the root alone included): fed causally, no mask."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def leaves(self) -> list[int]:
        return [i for i, kids in enumerate(self.children) if not kids]

    def longest_path(self, accepts) -> list[int]:
        """The longest path from the root (included) whose every node passes accepts(parent, child);
        of paths equally long, the first in the children's order (siblings holding the same token are
        all explored: the deeper match wins). Greedy verification and Medusa's typical acceptance."""
        def longest(node: int) -> list[int]:
            best: list[int] = []
            for child in self.children[node]:
                if accepts(node, child):
                    below = longest(child)
                    if len(below) + 1 > len(best):
                        best = [child] + below
            return best
        return [0] + longest(0)

    def ancestor_mask(self) -> torch.Tensor:
        """(n, n) bool: [i, j] is True when j is i or one of its ancestors."""
        return torch.from_numpy(ancestor_rows(tuple(self.parents)).copy())


@dataclass
class DeviceTree:
    """A drafted tree still on the draft's device, scored by the target before the host reads it. The
    host reads `read` in the same read as verification's argmax (loop.Scores.argmax_rows), so a step
    makes the host wait once, not once for the draft and again for verification; `settle` then turns
    the values read into the TokenTree that verification and the proposer's commit see. Its shape is
    the host's (a static tree's parents) or the device's (EAGLE-2's, chosen by the draft's scores)."""

    root: int  # node 0's token, the last committed one
    tokens: torch.Tensor  # (n,) long: node 0 the root, parents before children
    parents: tuple[int, ...] | torch.Tensor  # per node, -1 for the root: on the host, or (n,) long on the device
    depths: tuple[int, ...] | torch.Tensor  # per node, where the parents are
    height: int  # no node is deeper (the ancestor walk's length where the device holds the shape)
    read: torch.Tensor  # (r,) float64 on the device: what settle needs (float64 holds every id exactly)
    settle: Callable[[list[float]], TokenTree]  # the values of `read` -> the tree drafted

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def is_chain(self) -> bool:
        return not isinstance(self.parents, torch.Tensor) and all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestor_mask(self) -> torch.Tensor:
        """(n, n) bool on the device, for a shape held there (a host shape is laid out on the host,
        loop.layout): [i, j] is True when j is i or one of its ancestors."""
        n, device = len(self), self.parents.device
        up, rows = self.parents.clamp(min=0), torch.arange(n, device=device)  # the root is its own parent
        mask = torch.eye(n, dtype=torch.bool, device=device)
        node = rows
        for _ in range(self.height):  # each node's ancestor one depth further up, marked
            node = up.index_select(0, node)
            mask[rows, node] = True
        return mask


def host_tokens(tokens: Sequence) -> list[int]:
    """Drafted tokens as ints: those still on a device (1-element tensors) read in one read."""
    on_device = [i for i, t in enumerate(tokens) if isinstance(t, torch.Tensor)]
    out = list(tokens)
    if on_device:
        for i, token in zip(on_device, torch.cat([tokens[i].reshape(1) for i in on_device]).tolist()):
            out[i] = token
    return out


def drafted_tree(root: int, drafts: Sequence | torch.Tensor, parents: Sequence[int]) -> TokenTree | DeviceTree:
    """The tree of `root` and its drafted tokens in the shape `parents` (the drafts in node order after the
    root: ints, or still on the draft's device, one (n - 1,) tensor or 1-element tensors). Where reading
    them makes the host wait they stay there, read with verification's argmax (a DeviceTree); elsewhere
    they are read now."""
    if isinstance(drafts, torch.Tensor):
        drafted = drafts.reshape(-1)
    elif any(isinstance(t, torch.Tensor) for t in drafts):
        if not all(isinstance(t, torch.Tensor) for t in drafts):
            raise ValueError("a tree's drafts are all on the device or all on the host")
        drafted = torch.cat([t.reshape(1) for t in drafts])  # (n - 1,)
    else:
        return TokenTree([root, *drafts], list(parents))
    if not transfer.reads_wait(drafted.device):
        return TokenTree([root, *drafted.tolist()], list(parents))
    parents = tuple(parents)
    depths = depths_of(parents)
    return DeviceTree(root, torch.cat([to_device([root], drafted.device, torch.long), drafted]), parents,
                      depths, max(depths), drafted.double(),
                      lambda values: TokenTree([root, *(int(v) for v in values)], list(parents)))


@functools.lru_cache(maxsize=256)
def depths_of(parents: tuple[int, ...]) -> tuple[int, ...]:
    """Each node's depth below the root (0), parents preceding their children."""
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return tuple(depths)


@functools.lru_cache(maxsize=256)
def ancestor_rows(parents: tuple[int, ...]) -> np.ndarray:
    """TokenTree.ancestor_mask as a read-only numpy array, by the tree's parents. Cached: a static
    tree (Medusa's choices, Sequoia's, recycling's template) has the same parents at every step."""
    n = len(parents)
    # Filled in Python, made an array once: a tensor operation per node cost 0.2 ms a step for a
    # 25-node tree (results/reference/step_overhead/).
    rows = bytearray(n * n)
    for i in range(n):
        j = i
        while j >= 0:  # the node, then its ancestors up to the root
            rows[i * n + j] = 1
            j = parents[j]
    mask = np.frombuffer(bytes(rows), dtype=np.bool_).reshape(n, n)
    mask.flags.writeable = False  # shared by every caller of the cache
    return mask


# ---- trees of rank paths (Medusa's choices, token recycling's template) ----------------------
# A rank path (r0, r1, ...) names the node whose first token is rank r0 of its source at depth 0,
# whose second is rank r1 at depth 1, and so on; a tree is a prefix-closed set of such paths.

def ancestors(parents: Sequence[int], node: int) -> list[int]:
    """`node`'s ancestors below the root (node 0), nearest first, in a tree given by each node's parent."""
    found, a = [], parents[node]
    while a > 0:
        found.append(a)
        a = parents[a]
    return found


def best_paths(accuracy: list[list[float]], size: int, top_k: int) -> list[tuple[int, ...]]:
    """The `size` rank paths of largest product of accuracies (a path's value never exceeds its
    prefix's, so growing from the root by a heap keeps the set closed under prefixes)."""
    depth, ranks = len(accuracy), min(top_k, len(accuracy[0]) if accuracy else 0)
    heap = [(-accuracy[0][r], (r,)) for r in range(ranks)] if depth else []
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < size:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(heap, (neg * accuracy[len(path)][r], path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))


def prior_accuracy(k: int, top_k: int) -> list[list[float]]:
    return [[0.6 ** (i + 1) * 0.5 ** r for r in range(top_k)] for i in range(k)]


@functools.cache
def published_trees() -> dict[str, dict[str, list[tuple[int, ...]]]]:
    """The trees their authors published, as rank paths, per method and name (decoders/published_trees.json,
    with each one's source): e.g. EAGLE-1's and Medusa-1's mc_sim_7b_63, which are different trees."""
    data = json.loads((Path(__file__).resolve().parents[1] / "published_trees.json").read_text())
    return {method: {name: [tuple(p) for p in tree["paths"]] for name, tree in trees.items()}
            for method, trees in data.items()}


def given_paths(key: str, value, method: str) -> list[tuple[int, ...]] | None:
    """decoder.<key> as rank paths: a list of them (prefix-closed), or the name of a tree `method`'s
    authors published; None where `value` is a string naming none."""
    if isinstance(value, str):
        return published_trees().get(method, {}).get(value)
    paths = [tuple(int(r) for r in p) for p in value]
    if not paths or any(not p or min(p) < 0 for p in paths):
        raise ValueError(f"decoder.{key}: a list of non-empty rank paths of integers >= 0, e.g. [[0], [1], [0, 0]]")
    rank_tree(paths, key)  # prefix-closed, or a clear error now
    return paths


class RankTree(NamedTuple):
    """A tree of rank paths without its tokens: each node's parent (node 0 = the root) and, per node
    after the root, the slot (depth - 1, rank) that supplies its token (Medusa: (head, rank))."""

    parents: list[int]
    slots: list[tuple[int, int]]


def rank_tree(paths: list[tuple[int, ...]], key: str = "choices") -> RankTree:
    """The rank tree of a prefix-closed set of paths (`key` names the setting in errors)."""
    paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, slots = [-1], []
    for p in paths:
        if p[:-1] not in index:
            raise ValueError(f"decoder.{key}: path {list(p)} has no parent path {list(p[:-1])} in the set")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        slots.append((len(p) - 1, p[-1]))
    return RankTree(parents, slots)
