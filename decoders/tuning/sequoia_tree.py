"""Sequoia's speculation tree (Chen et al. 2024): the tree that maximises expected tokens per
step under the positional acceptance model, and the hardware-aware choice of its size and depth
given latencies.

Positional acceptance: p_k is the probability that the k-th drafted child of a node (children
drawn in order, without replacement) is the one the target accepts, k = 1..K, so sum_k p_k <= 1.
A node's score is the product of p_rank along its path from the root; a tree's expected tokens
per step is the sum of its scores (the root scores 1: verification always yields the target's
own token).

The dynamic program: f(n, d) = best value of a subtree of exactly n nodes and depth <= d;
its root's children (ranks 1..c, contiguous) share n - 1 nodes, and
    g_k(m, d) = max_j  p_k f(j, d - 1) + g_{k+1}(m - j, d)     (ranks k.. hold m nodes)
    f(n, d) = 1 + g_1(n - 1, d).
Each (d, k) layer is one max-plus convolution, vectorised: O(depth x K x budget^2).

Pure: no model runs here. Measuring the acceptance vector and the latencies is
sequoia_acceptance.py's job.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

_TIE = 1e-12  # relative: values this close count as equal, so ties break by rule, not by rounding

Latency = Callable[[int], float] | Mapping[int, float]


# ---- tree shapes ------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeShape:
    """A speculation tree without tokens: node 0 is the root; nodes are in BFS (level) order,
    a node's children consecutive and in rank order (first = rank 1)."""

    parents: tuple[int, ...]
    expected_tokens: float  # under the acceptance vector it was built for (root = 1)

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def budget(self) -> int:
        """Draft nodes (the root is the last committed token, not a draft)."""
        return self.size - 1

    def depths(self) -> list[int]:
        out = [0] * self.size
        for i in range(1, self.size):
            out[i] = out[self.parents[i]] + 1
        return out

    @property
    def depth(self) -> int:
        return max(self.depths())

    def level_widths(self) -> list[int]:
        """Nodes per level, root level first."""
        widths = [0] * (self.depth + 1)
        for d in self.depths():
            widths[d] += 1
        return widths

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.parents]
        for i, parent in enumerate(self.parents[1:], start=1):
            out[parent].append(i)
        return out

    def ranks(self) -> list[int]:
        """Each node's rank among its siblings (1 = drafted first); 0 for the root."""
        out = [0] * self.size
        for kids in self.children():
            for rank, child in enumerate(kids, start=1):
                out[child] = rank
        return out


def check_acceptance(acceptance: Sequence[float]) -> list[float]:
    try:
        p = [float(x) for x in acceptance]
    except (TypeError, ValueError):
        raise ValueError(("the acceptance vector must be a list of numbers p_1..p_K, "
                          f"got {acceptance!r}")[:300]) from None
    if not p:
        raise ValueError("the acceptance vector is empty: it needs p_1..p_K, K >= 1")
    if any(not (0.0 <= x <= 1.0) for x in p):
        raise ValueError(f"acceptance probabilities must lie in [0, 1], got {p}")
    if sum(p) > 1 + 1e-6:
        raise ValueError("acceptance probabilities must sum to <= 1 (one child at most is accepted), "
                         f"got sum {sum(p):.6f}")
    return p


def expected_tokens(parents: Sequence[int], acceptance: Sequence[float]) -> float:
    """Sum of node scores: root 1, a child of rank k scores its parent's score x p_k."""
    p = check_acceptance(acceptance)
    if not parents or parents[0] != -1:
        raise ValueError("a tree needs node 0 as its root (parent -1)")
    score = [1.0] + [0.0] * (len(parents) - 1)
    seen = [0] * len(parents)
    for i, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must precede their children")
        seen[parent] += 1
        if seen[parent] > len(p):
            raise ValueError(f"node {parent} has more than K = {len(p)} children (the acceptance vector's length)")
        score[i] = score[parent] * p[seen[parent] - 1]
    return sum(score)


# ---- the dynamic program ----------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _tables(acceptance: tuple[float, ...], max_nodes: int, max_depth: int):
    """f[d][n] (n = 0..max_nodes, -inf where no tree fits) and choice[d][k][m]: the size of
    the rank-(k+1) child's subtree when ranks k+1.. share m nodes under depth budget d."""
    n_all = max_nodes + 1
    K = len(acceptance)
    m = np.arange(n_all)[:, None]
    j = np.arange(n_all)[None, :]
    valid = (j >= 1) & (j <= m)  # the rank-k child takes j >= 1 of the m nodes
    rest = np.clip(m - j, 0, None)
    leaf = np.full(n_all, -np.inf)
    leaf[1] = 1.0
    f = [leaf]
    choice = [None]
    for d in range(1, max_depth + 1):
        below = f[d - 1]
        g = np.full(n_all, -np.inf)  # ranks K+1..: nothing left to hold nodes
        g[0] = 0.0
        picks = [None] * K
        for k in range(K - 1, -1, -1):
            child = np.full(n_all, -np.inf)
            fits = np.isfinite(below)
            child[fits] = acceptance[k] * below[fits]  # multiplying -inf by p_k = 0 would give nan
            total = np.where(valid, child[None, :] + g[rest], -np.inf)
            best = total.max(axis=1)
            # Ties: the largest subtree for the earlier rank (argmax over j reversed).
            near = total >= best[:, None] - _TIE * np.maximum(1.0, np.abs(best[:, None]))
            pick = n_all - 1 - np.argmax(near[:, ::-1], axis=1)
            g = np.where(m[:, 0] == 0, 0.0, best)
            pick[0] = 0
            picks[k] = pick
        fd = np.full(n_all, -np.inf)
        fd[1:] = 1.0 + g[:-1]
        f.append(fd)
        choice.append(picks)
    return f, choice


def _nested(choice, n: int, d: int) -> list:
    """The subtree of n nodes and depth budget d as nested lists of children, in rank order."""
    sizes, m, k = [], n - 1, 0
    while m > 0:
        j = int(choice[d][k][m])
        sizes.append(j)
        m, k = m - j, k + 1
    return [_nested(choice, j, d - 1) for j in sizes]


def _bfs_parents(root: list) -> tuple[int, ...]:
    parents, queue = [-1], [root]
    for index, node in enumerate(queue):  # the queue grows while we walk it: level order
        for child in node:
            parents.append(index)
            queue.append(child)
    return tuple(parents)


def _check_sizes(budget: int, max_depth: int) -> None:
    if not (isinstance(budget, (int, np.integer)) and budget >= 0):
        raise ValueError(f"tree budget (draft nodes) must be an integer >= 0, got {budget!r}")
    if not (isinstance(max_depth, (int, np.integer)) and max_depth >= 0):
        raise ValueError(f"tree max_depth must be an integer >= 0, got {max_depth!r}")


def optimal_tree(acceptance: Sequence[float], budget: int, max_depth: int) -> TreeShape:
    """The tree of at most `budget` draft nodes and depth <= max_depth, each node with at most
    K = len(acceptance) children, that maximises expected tokens per step. Ties go to the
    smallest tree, then to larger subtrees under earlier ranks."""
    p = tuple(check_acceptance(acceptance))
    _check_sizes(budget, max_depth)
    depth = min(max_depth, budget)  # a deeper limit cannot be used
    f, choice = _tables(p, budget + 1, depth)
    values = f[depth][1:budget + 2]
    best = values.max()
    n = 1 + int(np.argmax(values >= best - _TIE * max(1.0, best)))  # smallest tree within a rounding of the best
    parents = _bfs_parents(_nested(choice, n, depth))
    return TreeShape(parents, float(f[depth][n]))


# ---- hardware-aware size and depth ------------------------------------------------------
def _seconds(latency: Latency, tokens: int) -> float:
    if callable(latency):
        return float(latency(tokens))
    if tokens not in latency:
        raise ValueError(f"no latency for a forward of {tokens} tokens (the table has {min(latency)}..{max(latency)})")
    return float(latency[tokens])


def time_per_step(shape: TreeShape, target_latency: Latency, draft_latency: Latency) -> float:
    """One target forward of the whole tree + one draft forward per level that has children
    (it feeds that level's nodes and drafts the next level)."""
    widths = shape.level_widths()
    return _seconds(target_latency, shape.size) + sum(_seconds(draft_latency, w) for w in widths[:shape.depth])


def predicted_time_per_token(shape: TreeShape, target_latency: Latency, draft_latency: Latency) -> float:
    return time_per_step(shape, target_latency, draft_latency) / shape.expected_tokens


def choose_tree(acceptance: Sequence[float], target_latency: Latency, draft_latency: Latency,
                budgets: Sequence[int], depths: Sequence[int], autoregressive_s: float | None = None
                ) -> tuple[TreeShape, dict]:
    """The optimal tree, over budgets x depths, with the least predicted time per token.
    autoregressive_s: one autoregressive target step (default: target_latency(1)), the
    baseline of the predicted speedup. Ties keep the first grid point."""
    if not budgets or not depths:
        raise ValueError(f"choose_tree needs at least one budget and one depth, got budgets={list(budgets)} "
                         f"depths={list(depths)}")
    unit = _seconds(target_latency, 1) if autoregressive_s is None else float(autoregressive_s)
    table, best, best_shape = [], None, None
    for budget in budgets:
        for depth in depths:
            shape = optimal_tree(acceptance, budget, depth)
            step = time_per_step(shape, target_latency, draft_latency)
            row = {"budget": int(budget), "depth": int(depth), "size": shape.size, "tree_depth": shape.depth,
                   "expected_tokens": shape.expected_tokens, "time_per_step": step,
                   "predicted_time_per_token": step / shape.expected_tokens,
                   "predicted_speedup": unit * shape.expected_tokens / step}
            table.append(row)
            if best is None or row["predicted_time_per_token"] < best["predicted_time_per_token"]:
                best, best_shape = row, shape
    return best_shape, {**best, "autoregressive_s": unit, "table": table}


def cumulative(acceptance: Sequence[float]) -> list[float]:
    """P(one of the first k children is accepted), k = 1..K."""
    return [math.fsum(acceptance[:k]) for k in range(1, len(acceptance) + 1)]
