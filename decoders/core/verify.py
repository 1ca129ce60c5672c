"""Verification of a token tree against one target forward pass.

Both functions return (path, next_token): `path` holds the accepted node indices from the
root (node 0) down, and `next_token` is the token the target itself contributes after the
path (the "bonus" token). The committed tokens are the path's tokens after the root,
then next_token.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from . import transfer
from .sampling import ArgmaxRows, NonFiniteLogits, draw
from .transfer import to_device
from .tree import TokenTree


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor,
                  predicted: ArgmaxRows | Sequence[int] | None = None) -> tuple[list[int], int]:
    """Longest path whose every token is the target's argmax after its parent (TokenTree.longest_path).
    predicted: each row's argmax by index, where the caller reads them (loop.Scores.argmax_rows);
    by default read from target_logits as the walk reaches them (ArgmaxRows)."""
    if predicted is None:
        predicted = ArgmaxRows(target_logits)
    path = tree.longest_path(lambda node, child: tree.tokens[child] == predicted[node])
    return path, predicted[path[-1]]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The target's distribution after a rejected draw from q: norm(max(p - q, 0)), row by row; p itself
    where that is zero (p == q: rejection had probability 0). Nothing is read: no host wait on a GPU."""
    r = torch.clamp(p - q, min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total, p)


def without(q: torch.Tensor, tokens) -> torch.Tensor:
    """Each row of q with its token (tokens[i] in row i, or one token for a 1-D q) removed, renormalised:
    the next sibling's draft distribution when siblings were drawn without replacement."""
    q = q.clone()
    if q.dim() == 1:
        q[tokens] = 0
    else:
        q[torch.arange(len(q), device=q.device), tokens] = 0
    total = q.sum(-1, keepdim=True)
    return torch.where(total > 0, q / total, q)


def verify_sampling(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                    generator: torch.Generator | None, without_replacement: bool = False,
                    draws: list[list[int]] | None = None) -> tuple[list[int], int]:
    """Stochastic verification that preserves the target distribution.

    target_probs: (n, V), the target's sampling distribution after each node.
    draft_probs: (n, V), row c = the distribution node c's token was drawn from (its
      parent's draft distribution), or None for deterministic candidates (point masses, as
      lookahead's n-gram guesses).
    At each node the children are tried in order: child x is accepted with probability
    min(1, p(x) / q(x)); on rejection p becomes the residual norm(max(p - q, 0)). With
    deterministic candidates this is "accept with p(x), else zero p(x) and renormalise".
    without_replacement (Sequoia): siblings were drawn without replacement, so after each
    rejection the draft distribution for the next sibling drops the rejected token.
    If every child is rejected, the next token is sampled from the residual.
    draws: per node, the child of each draft draw in draw order, duplicates repeated (SpecInfer's
      trie merges equal draws into one child, but every draw must be tried: a repeated token
      is always rejected once its twin was, yet each rejection subtracts q again). Default:
      tree.children, one try per child.

    On a CPU the walk computes what it reaches, child by child. Where a read makes the host wait (a GPU),
    every node's tries are computed on the device first and read at once with the draws (read_at_once).
    """
    order = tree.children if draws is None else draws
    if transfer.reads_wait(target_probs.device):
        return read_at_once(tree, target_probs, draft_probs, generator, without_replacement, order)
    node, path = 0, [0]
    while True:
        p = target_probs[node]
        q_shared = None  # the running without-replacement draft distribution of these siblings
        accepted = None
        for child in order[node]:
            x = tree.tokens[child]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            elif without_replacement:
                q = draft_probs[child] if q_shared is None else q_shared
            else:
                q = draft_probs[child]
            if q[x] <= 0:
                raise ValueError(f"node {child} holds token {x}, which its draft distribution gives probability 0")
            u = torch.rand((), generator=generator, device=p.device)
            # Strict: u is in [0, 1), so this accepts with probability min(1, p/q), and never when p(x) = 0.
            if u * q[x] < p[x]:
                accepted = child
                break
            p = residual(p, q)
            if without_replacement and draft_probs is not None:
                q_shared = without(q, x)
        if accepted is None:
            return path, draw(p, generator)
        path.append(accepted)
        node = accepted


def read_at_once(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                 generator: torch.Generator | None, without_replacement: bool,
                 order: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """verify_sampling with one host read a step, for a device where each read waits. The i-th tries of
    every node are computed together on the device (p(x) and q(x) as each try sees them, then the residual),
    a uniform is drawn for every try and a bonus token from every node's distribution after all its tries;
    one read brings them all, and the host walks the tree on those values. Each draw is used at most once
    on the path walked, so the output's distribution is verify_sampling's."""
    device, n = target_probs.device, len(tree)
    widest = max(map(len, order), default=0)
    rest = target_probs[:n]  # per node: the distribution its next try sees; after the last, the bonus's
    q_shared = None
    seen = []  # per try index i: (nodes with an i-th try, p(x), q(x))
    for i in range(widest):
        nodes = [node for node in range(n) if len(order[node]) > i]
        children = [order[node][i] for node in nodes]
        tokens = to_device([tree.tokens[c] for c in children], device)
        at = to_device(nodes, device)
        rows = torch.arange(len(nodes), device=device)
        p = rest[at]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[rows, tokens] = 1.0
        elif without_replacement and i:
            q = q_shared[at]
        else:
            q = draft_probs[to_device(children, device)]
        seen.append((nodes, p[rows, tokens], q[rows, tokens]))
        rest = rest.index_put((at,), residual(p, q))
        if without_replacement and draft_probs is not None:
            q_shared = (torch.zeros_like(target_probs[:n]) if q_shared is None else q_shared).index_put(
                (at,), without(q, tokens))
    total = sum(len(nodes) for nodes, _, _ in seen)
    uniforms = torch.rand(total, generator=generator, device=device)
    bonus = torch.multinomial(rest, 1, generator=generator)
    read = torch.cat([*(t.double() for _, px, qx in seen for t in (px, qx)), uniforms.double(),
                      bonus.view(-1).double(), rest.gather(1, bonus).view(-1).double()]).tolist()
    tries, at, u_at = {}, 0, 2 * total  # (node, i) -> (p(x), q(x), u)
    for i, (nodes, _, _) in enumerate(seen):
        for j, node in enumerate(nodes):
            tries[node, i] = read[at + j], read[at + len(nodes) + j], read[u_at + j]
        at, u_at = at + 2 * len(nodes), u_at + len(nodes)
    bonus_at = 3 * total
    node, path = 0, [0]
    while True:
        for i, child in enumerate(order[node]):
            px, qx, u = tries[node, i]
            if qx <= 0:
                raise ValueError(f"node {child} holds token {tree.tokens[child]}, which its draft distribution "
                                 "gives probability 0")
            if u * qx < px:  # strict, as verify_sampling's
                path.append(child)
                node = child
                break
        else:
            token, chance = read[bonus_at + node], read[bonus_at + n + node]
            if not math.isfinite(chance):  # as sampling.draw's: a distribution that held NaN or inf
                raise NonFiniteLogits(chance)
            return path, int(token)
