"""tree_size=auto for the rank trees (Medusa's heads, EAGLE's draft): of the candidate sizes, the
tree with the most forecast tokens per unit of time on this device. A size's tree is its best rank
paths under the draft's measured accuracy by depth and rank (tree.best_paths); a step costs a
forward of the tree and its root (the device's latency profile, profile.step_cost) plus the
drafting of that tree, both in autoregressive steps."""
from __future__ import annotations

import math
from typing import Callable

from ..core.contract import check, check_list
from ..core.tree import best_paths


def check_sizes(tree_size, auto_sizes) -> int:
    """Checks a decoder's tree_size (an integer >= 1 or auto) and auto_sizes; returns the widest tree
    it may verify (auto: the largest of auto_sizes)."""
    check("tree_size", tree_size, at_least=1, also=("auto",))
    check_list("auto_sizes", auto_sizes, at_least=1)
    return max(auto_sizes) if tree_size == "auto" else tree_size


def expected_tokens(accuracy: list[list[float]], paths) -> float:
    """The forecast to set beside the measured mean_accepted_tokens: 1 (the bonus) + each path's
    chance of acceptance (ranks at one depth are exclusive events, depths taken as independent)."""
    return 1.0 + sum(math.prod(accuracy[i][r] for i, r in enumerate(p)) for p in paths)


def choose_size(accuracy, ranks: int, sizes, verify_cost: Callable[[int], float],
                draft_cost: Callable[[int], float]) -> tuple[int, dict, list[dict]]:
    """Of `sizes`, the tree size with the most forecast tokens per unit of time: a step costs
    verify_cost(size + 1) + draft_cost(depth of that size's tree), in autoregressive steps (heads
    cost the same at any depth; a feature draft runs once per depth), so predicted_speedup =
    expected tokens / that cost. Returns the size, what auto reports (its forecast, depth and
    drafting cost) and the table it chose from."""
    table = []
    for size in sorted(set(sizes)):
        paths = best_paths(accuracy, size, ranks)
        depth = max(map(len, paths), default=0)
        expected, drafting = expected_tokens(accuracy, paths), draft_cost(depth)
        cost = verify_cost(size + 1) + drafting
        table.append({"tree_size": size, "depth": depth, "expected_tokens": expected, "draft_cost": drafting,
                      "step_cost": cost, "predicted_speedup": expected / cost})
    best = max(table, key=lambda row: row["predicted_speedup"])
    chosen = {k: best[k] for k in ("predicted_speedup", "expected_tokens", "depth", "draft_cost")}
    return best["tree_size"], chosen, table
