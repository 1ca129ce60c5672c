"""Verification of a token tree against one target forward pass.

Both functions return (path, next_token): `path` holds the accepted node indices from the
root (node 0) down, and `next_token` is the token the target itself contributes after the
path (the "bonus" token). The committed tokens are the path's tokens after the root,
then next_token.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .sampling import ArgmaxRows, draw
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
    """The target's distribution after a rejected draw from q: norm(max(p - q, 0))."""
    r = torch.clamp(p - q, min=0)
    return r / r.sum() if r.sum() > 0 else p  # p == q: rejection had probability 0


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
    """
    node, path = 0, [0]
    while True:
        p = target_probs[node].clone()
        q_shared = None  # the running without-replacement draft distribution of these siblings
        accepted = None
        for child in (tree.children if draws is None else draws)[node]:
            x = tree.tokens[child]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            elif without_replacement:
                q = draft_probs[child].clone() if q_shared is None else q_shared
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
                q_shared = q.clone()
                q_shared[x] = 0
                q_shared = q_shared / q_shared.sum() if q_shared.sum() > 0 else q_shared
        if accepted is None:
            return path, draw(p, generator)
        path.append(accepted)
        node = accepted
