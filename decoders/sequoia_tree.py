"""Sequoia's speculation tree (Chen et al. 2024): the tree that maximises expected tokens per
step under the positional acceptance model, the hardware-aware choice of its size and depth,
and the measurement of the acceptance vector itself.

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
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .lm import LM
from .profile import forward_latency, step_cost
from .sampling import Sampling, probs
from .tree import TokenTree
from .verify import verify_sampling

ACCEPTANCE_FORMAT = "sequoia-acceptance-v1"
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
        raise ValueError(f"the acceptance vector must be a list of numbers p_1..p_K, got {acceptance!r}"[:300]) from None
    if not p:
        raise ValueError("the acceptance vector is empty: it needs p_1..p_K, K >= 1")
    if any(not (0.0 <= x <= 1.0) for x in p):
        raise ValueError(f"acceptance probabilities must lie in [0, 1], got {p}")
    if sum(p) > 1 + 1e-6:
        raise ValueError(f"acceptance probabilities must sum to <= 1 (one child at most is accepted), got sum {sum(p):.6f}")
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


# ---- acceptance vectors on disk ---------------------------------------------------------
def save_acceptance(path: str | os.PathLike, acceptance: Sequence[float], info: dict) -> None:
    """JSON: the vector, its cumulative sums (P(some child among the first k is accepted)) and provenance."""
    p = check_acceptance(acceptance)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": ACCEPTANCE_FORMAT, "acceptance": p, "cumulative": cumulative(p), "info": info}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1, default=str))
    tmp.replace(path)


def load_acceptance(path: str | os.PathLike) -> list[float]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no acceptance vector at {path}; measure one with scripts/measure_acceptance.py")
    try:
        body = json.loads(path.read_bytes())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not an acceptance vector: not JSON ({str(e).split(':')[0]}); measure one with "
                         "scripts/measure_acceptance.py") from None
    if not isinstance(body, dict) or body.get("format") != ACCEPTANCE_FORMAT or "acceptance" not in body:
        raise ValueError(f"{path} is not an acceptance vector (format {ACCEPTANCE_FORMAT!r} expected)")
    return check_acceptance(body["acceptance"])


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


def profile_latency(profile: dict) -> Callable[[int], float]:
    """Seconds of a forward of n tokens from a decoders.profile latency profile (extrapolated past its end)."""
    return lambda n: step_cost(profile, n) * profile["autoregressive_s"]


def device_latency(lm: LM, draft: LM, cache_dir=None, max_tokens: int = 64) -> tuple[Callable, Callable, float]:
    """(target latency, draft latency, one autoregressive target step in seconds) on this
    device, from the cached profiles of both LMs (measured on first use)."""
    target = forward_latency(lm, cache_dir, max_tokens=max_tokens)
    drafter = forward_latency(draft, cache_dir, max_tokens=max_tokens)
    return profile_latency(target), profile_latency(drafter), float(target["autoregressive_s"])


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


# ---- measuring the acceptance vector ----------------------------------------------------
def _greedy_rank(target_logits: torch.Tensor, draft_logits: torch.Tensor, K: int) -> tuple[int, int]:
    """(rank 1..K of the target's argmax among the draft's top K, 0 if absent; next token)."""
    token = int(torch.argmax(target_logits))
    top = torch.topk(draft_logits, K).indices.tolist()
    first = int(torch.argmax(draft_logits))  # the rank-1 child is the draft's argmax, as a chain drafts it
    if top[0] != first:  # topk may order exact ties differently from argmax
        if first in top:
            top.remove(first)
        else:
            top.pop()
        top.insert(0, first)
    return (top.index(token) + 1 if token in top else 0), token


def _sampled_rank(target_p: torch.Tensor, draft_q: torch.Tensor, K: int, generator) -> tuple[int, int]:
    """K draft tokens drawn without replacement, verified as one tree level by Sequoia's
    sequential rejection. Returns (the accepted child's rank, 0 if none; the committed token,
    which is distributed as the target's)."""
    n = min(K, int((draft_q > 0).sum()))
    drafts = torch.multinomial(draft_q, n, replacement=False, generator=generator).tolist()
    tree = TokenTree([0, *drafts], [-1] + [0] * n)
    path, bonus = verify_sampling(tree, target_p.expand(len(tree), -1), draft_q.expand(len(tree), -1),
                                  generator, without_replacement=True)
    if len(path) > 1:
        return path[1], tree.tokens[path[1]]
    return 0, bonus


def acceptance_counts(lm: LM, draft: LM, prompt_ids_list: Sequence[Sequence[int]], K: int,
                      sampling: Sampling | None, max_new_tokens: int) -> tuple[list[int], int]:
    """How often each rank 1..K was the accepted child, over every generated position, and the
    number of positions. The target generates (greedy, or sampling through the verification
    itself); target and draft each take one cached forward per position."""
    if not (isinstance(K, int) and 1 <= K <= min(lm.vocab_size, draft.vocab_size)):
        raise ValueError(f"K (children per node) must be an integer in [1, vocab size], got {K!r}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    sampling = sampling or Sampling()
    warpers = sampling.warpers()
    generator = sampling.generator(lm.device)
    counts, positions = [0] * (K + 1), 0  # counts[0]: no child accepted
    for prompt in prompt_ids_list:
        prompt = list(prompt)
        room = max_new_tokens if lm.max_context is None else min(max_new_tokens, lm.max_context - len(prompt))
        if room < 1:
            continue
        cache, draft_cache = lm.new_cache(), draft.new_cache()
        t_logits = lm.forward(prompt, cache, last_only=True)[-1]
        d_logits = draft.forward(prompt, draft_cache, last_only=True)[-1].to(t_logits.device)
        for i in range(room):
            if sampling.greedy:
                rank, token = _greedy_rank(t_logits, d_logits, K)
            else:
                p = probs(t_logits[None], sampling, warpers)[0]
                q = probs(d_logits[None], sampling, warpers)[0]
                rank, token = _sampled_rank(p, q, K, generator)
            counts[rank] += 1
            positions += 1
            if token in lm.stop_ids or i == room - 1:
                break
            t_logits = lm.forward([token], cache, last_only=True)[-1]
            d_logits = draft.forward([token], draft_cache, last_only=True)[-1].to(t_logits.device)
    return counts[1:], positions


def measure_acceptance(lm: LM, draft: LM, prompt_ids_list: Sequence[Sequence[int]], K: int,
                       sampling: Sampling | None, max_new_tokens: int) -> list[float]:
    """p_k, k = 1..K: the share of generated positions where the draft's k-th child is the accepted one."""
    counts, positions = acceptance_counts(lm, draft, prompt_ids_list, K, sampling, max_new_tokens)
    if not positions:
        raise ValueError("no position measured: every prompt fills the model's context")
    return [c / positions for c in counts]


def model_fingerprint(lm: LM, shared_with: LM | None = None) -> str:
    """Name, config, dtype, and a checksum of the weights not shared with `shared_with` (a
    self-draft's exit adapter; all of a separate draft's)."""
    shared = {p.data_ptr() for p in shared_with.model.parameters()} if shared_with is not None else set()
    own = [(n, tuple(p.shape), round(float(p.detach().double().sum()), 6))
           for n, p in lm.model.named_parameters() if p.data_ptr() not in shared]
    config = json.dumps(lm.config.to_dict(), sort_keys=True, default=str)
    raw = json.dumps([lm.name, config, str(lm.dtype), own if shared_with is not None else []], default=str)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def cached_acceptance(lm: LM, draft: LM, prompt_ids_list: Sequence[Sequence[int]], K: int,
                      sampling: Sampling | None, max_new_tokens: int, cache_dir=None, info: dict | None = None
                      ) -> list[float]:
    """measure_acceptance, cached under cache_dir/acceptance/ keyed by target, draft, the
    calibration prompts' hash, temperature/top_p/top_k (and seed when sampling), K and length."""
    sampling = sampling or Sampling()
    prompts = [list(map(int, p)) for p in prompt_ids_list]
    key = {"target": model_fingerprint(lm), "draft": model_fingerprint(draft, shared_with=lm),
           "prompts": hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:16],
           "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
           "seed": None if sampling.greedy else sampling.seed, "K": K, "max_new_tokens": max_new_tokens}
    path = None
    if cache_dir:
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cache_dir).expanduser() / "acceptance" / f"sequoia-{digest}.json"
        if path.exists():
            return load_acceptance(path)
    counts, positions = acceptance_counts(lm, draft, prompts, K, sampling, max_new_tokens)
    if not positions:
        raise ValueError("no position measured: every calibration prompt fills the model's context")
    acceptance = [c / positions for c in counts]
    if path is not None:
        save_acceptance(path, acceptance, {**(info or {}), **key, "target_name": lm.name, "draft_name": draft.name,
                                           "prompts_count": len(prompts), "positions": positions})
    return acceptance


def cumulative(acceptance: Sequence[float]) -> list[float]:
    """P(one of the first k children is accepted), k = 1..K."""
    return [math.fsum(acceptance[:k]) for k in range(1, len(acceptance) + 1)]
