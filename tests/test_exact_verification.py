"""verify_sampling is lossless, checked EXACTLY: the output distribution of the real code,
computed by enumerating every branch of its randomness, equals the target's within 1e-9.

How: decoders.core.verify's `torch` is swapped for a proxy whose `rand` returns a symbolic uniform
u, so the production comparison `u * q[x] < p[x]` becomes a branch taken with probability
min(1, p[x] / q[x]), and whose `multinomial` branches over the support of its argument. An
Oracle replays a script of branch choices and logs each branch's probabilities; a depth-first
search over scripts visits every outcome once, weighted by the product of its branches. The
draft's own draws (with replacement for chains and SpecInfer, without for Sequoia) go through
the same Oracle, and so does the next step's target sample when a step commits one token.

Cases: spec chain, SpecInfer's merged trie (k = 2, 3, via decoders.methods.specinfer.merge_chains),
Sequoia (siblings without replacement), deterministic candidates (point-mass drafts with
duplicate tokens), a block draft's chain (each position drawn from its own distribution, which
does not depend on the draws before it) and its DDTree tree (decoders.methods.dflash.ddtree).
Negative controls, caught by the same check: SpecInfer's duplicates merged (one try per distinct
child: the bug this file was written for), wrong residuals, Sequoia's drafts verified as if drawn
with replacement, a block draft's drawn chain verified against rows other than those it was drawn
from and its tree as if drawn. Finally SpecInfer end to end passes verify_sampling
its draws in draw order, duplicates included.
"""
from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
import torch

import decoders.methods.specinfer as specinfer_module
import decoders.core.loop as loop_module
import decoders.core.sampling as sampling_module
import decoders.core.verify as verify_module
from decoders.methods.draft_model import SelfDraft
from decoders.core.sampling import Sampling
from decoders.methods.specinfer import SpecInfer, chains, merge_chains
from decoders.core.tree import TokenTree
from decoders.methods.dflash import ddtree
from decoders.methods.draft_tree import DraftTree
from decoders.core.verify import verify_sampling
from helpers import tiny_lm

EXACT = 1e-9  # correct verification: max L1 error (float64 rounding only)
DETECT = 1e-3  # a negative control must be off by more than this somewhere


# ---- exact enumeration ----------------------------------------------------------------------
class Oracle:
    """Scripted randomness: replays `script` (branch indices), then takes the first branch of
    positive probability; logs every decision as (choice, branch probabilities)."""

    def __init__(self, script: tuple[int, ...]):
        self.script, self.log = script, []

    def choose(self, probs) -> int:
        probs = [float(w) for w in probs]
        i = len(self.log)
        c = self.script[i] if i < len(self.script) else next(j for j, w in enumerate(probs) if w > 0)
        self.log.append((c, probs))
        return c


class _Uniform:
    """u ~ U[0, 1): `u * q < p` is true with probability min(1, p / q) (q > 0: verify_sampling
    raises before drawing otherwise)."""

    def __init__(self, oracle: Oracle, q: float = 1.0):
        self.oracle, self.q = oracle, q

    def __mul__(self, q):
        return _Uniform(self.oracle, self.q * float(q))

    def __lt__(self, p):
        accept = min(1.0, float(p) / self.q)
        return self.oracle.choose([accept, 1.0 - accept]) == 0


class _ScriptedTorch:
    """torch as decoders.core.verify sees it, with its two random draws answered by the oracle."""

    def __init__(self, oracle: Oracle):
        self.oracle = oracle

    def __getattr__(self, name):
        return getattr(torch, name)

    def rand(self, *args, **kwargs):
        return _Uniform(self.oracle)

    def multinomial(self, p, n, *args, **kwargs):
        assert n == 1 and not kwargs.get("replacement", False)
        w = p.double() / p.double().sum()  # torch.multinomial normalises too
        return torch.tensor([self.oracle.choose(w.tolist())])


def exact_distribution(run) -> dict:
    """{outcome: probability} of `run(oracle)` over every branch of the oracle's choices,
    with decoders.core.verify's randomness (its draw of the bonus token in sampling.draw) answered by
    the same oracle."""
    out: dict = defaultdict(float)
    stack: list[tuple[int, ...]] = [()]
    real = verify_module.torch
    try:
        while stack:
            script = stack.pop()
            oracle = Oracle(script)
            verify_module.torch = sampling_module.torch = _ScriptedTorch(oracle)
            outcome = run(oracle)
            out[outcome] += math.prod(probs[c] for c, probs in oracle.log)
            for i in range(len(script), len(oracle.log)):  # branches first taken in this run
                prefix = tuple(c for c, _ in oracle.log[:i])
                c, probs = oracle.log[i]
                stack += [prefix + (j,) for j, w in enumerate(probs) if w > 0 and j != c]
    finally:
        verify_module.torch = sampling_module.torch = real
    assert abs(sum(out.values()) - 1) < 1e-12
    return dict(out)


def test_enumeration_of_a_known_distribution():
    """The helper itself: a coin flip then a die, and the production comparison's branch."""
    def run(oracle):
        u = _Uniform(oracle)
        return (u * 0.8 < 0.2), oracle.choose([0.5, 0.0, 0.5])
    dist = exact_distribution(run)
    assert dist == pytest.approx({(True, 0): 0.125, (True, 2): 0.125, (False, 0): 0.375, (False, 2): 0.375})


# ---- random target / draft tables -----------------------------------------------------------
def _row(g: torch.Generator, V: int, zero: bool) -> torch.Tensor:
    """A random distribution over V (float64), one entry zeroed when `zero` (top-p / top-k)."""
    w = torch.rand(V, generator=g, dtype=torch.float64) ** 2 + 0.01
    if zero:
        w[int(torch.randint(0, V, (), generator=g))] = 0
    return w / w.sum()


class Tables:
    """Target p(.|prefix) and draft q(.|prefix) for every prefix of length <= 3. The target
    zeroes one token in half its rows; the draft in a third (at most one: Sequoia's siblings
    without replacement need support >= 3)."""

    def __init__(self, seed: int, V: int):
        g = torch.Generator().manual_seed(seed)
        self.V = V
        prefixes = [t for n in range(4) for t in itertools.product(range(V), repeat=n)]
        self.p = {t: _row(g, V, zero=bool(torch.rand((), generator=g) < 0.5)) for t in prefixes}
        self.q = {t: _row(g, V, zero=bool(torch.rand((), generator=g) < 0.3)) for t in prefixes}

    def target_rows(self, tree: TokenTree) -> torch.Tensor:
        return torch.stack([self.p[self.prefix(tree, n)] for n in range(len(tree))])

    def draft_rows(self, tree: TokenTree) -> torch.Tensor:
        """Row c: the distribution node c's token was drawn from (its parent's); root: unused."""
        return torch.stack([self.q[self.prefix(tree, n)[:-1]] for n in range(len(tree))])

    @staticmethod
    def prefix(tree: TokenTree, node: int) -> tuple[int, ...]:
        return tuple(tree.tokens[i] for i in tree.path(node)[1:])

    def joint(self, n: int) -> dict:
        """The target's exact distribution of its first n tokens (n = 1 or 2)."""
        if n == 1:
            return {(a,): float(self.p[()][a]) for a in range(self.V)}
        return {(a, b): float(self.p[()][a] * self.p[(a,)][b]) for a in range(self.V) for b in range(self.V)}


def committed(tables: Tables, tree: TokenTree, path: list[int], bonus: int, n: int, oracle: Oracle):
    """The first n tokens the step commits; the next step's target sample fills in the rest."""
    out = [tree.tokens[i] for i in path[1:]] + [bonus]
    while len(out) < n:
        out.append(oracle.choose(tables.p[tuple(out)]))
    return tuple(out[:n])


def l1(dist: dict, exact: dict) -> float:
    return sum(abs(dist.get(k, 0.0) - exact.get(k, 0.0)) for k in set(dist) | set(exact))


def draw_without_replacement(oracle: Oracle, q: torch.Tensor, n: int) -> list[int]:
    """n sequential draws from q, each dropping the tokens already drawn (as torch.multinomial
    without replacement)."""
    q, out = q.clone(), []
    for _ in range(n):
        x = oracle.choose(q / q.sum())
        out.append(x)
        q[x] = 0
    return out


# ---- the cases: run(oracle, tables) -> the committed tokens ------------------------------------
def spec_chain(depth: int, n: int, residual_ok=True):
    """One draft per level (decoders.methods.spec_chain): x_i ~ q(.|x_<i), a chain tree."""
    def run(oracle, t):
        drafts = []
        for _ in range(depth):
            drafts.append(oracle.choose(t.q[tuple(drafts)]))
        tree = TokenTree.chain(0, drafts)
        path, bonus = verify_sampling(tree, t.target_rows(tree), t.draft_rows(tree), None)
        return committed(t, tree, path, bonus, n, oracle)
    return run


def specinfer(k: int, depth: int, n: int, keep_draws: bool = True):
    """k chains drawn independently from the draft, merged by the production merge_chains.
    keep_draws=False: one try per distinct child (the old, lossy verification)."""
    parents = chains(k, depth)

    def run(oracle, t):
        tokens, prefix = [0], {0: ()}
        for i, parent in enumerate(parents[1:], start=1):  # level order: a chain's prefix is known
            x = oracle.choose(t.q[prefix[parent]])
            tokens.append(x)
            prefix[i] = prefix[parent] + (x,)
        dtree = DraftTree(tokens=tokens, parents=list(parents), dists=[None] + [t.q[prefix[p]] for p in parents[1:]],
                          cache_index={}, forward_tokens=0, flops=0.0)
        tree, draft_probs, _, draws = merge_chains(dtree)
        path, bonus = verify_sampling(tree, t.target_rows(tree), draft_probs, None,
                                      draws=draws if keep_draws else None)
        return committed(t, tree, path, bonus, n, oracle)
    return run


def sequoia(parents: list[int], n: int, without_replacement: bool = True):
    """A fixed tree shape whose siblings are drawn without replacement from the draft (Sequoia).
    without_replacement=False: verified as if drawn with replacement (wrong)."""
    kids = TokenTree([0] * len(parents), parents).children

    def run(oracle, t):
        tokens, prefix = [0] * len(parents), {0: ()}
        for node in range(len(parents)):  # parents precede children: their prefixes are known
            drawn = draw_without_replacement(oracle, t.q[prefix[node]], len(kids[node]))
            for child, x in zip(kids[node], drawn):
                tokens[child], prefix[child] = x, prefix[node] + (x,)
        tree = TokenTree(tokens, list(parents))
        path, bonus = verify_sampling(tree, t.target_rows(tree), t.draft_rows(tree), None,
                                      without_replacement=without_replacement)
        return committed(t, tree, path, bonus, n, oracle)
    return run


def block_rows(t, depth: int) -> list[torch.Tensor]:
    """A block draft's distributions: one per position, fixed before anything is drawn (one draft forward
    drafts the whole block), so position i's does not depend on the tokens at the positions before it."""
    return [t.q[(0,) * i] for i in range(depth)]


def dflash_chain(depth: int, n: int, drawn_rows: bool = True):
    """decoder=dflash's chain under sampling: position i's token drawn from its own row q_i, verified
    against the rows it was drawn from. drawn_rows=False: verified against other rows of the same
    support (q_i squared, renormalised: a draft's distribution before the run's temperature, say): wrong."""
    def run(oracle, t):
        rows = block_rows(t, depth)
        tree = TokenTree.chain(0, [oracle.choose(q) for q in rows])
        told = rows if drawn_rows else [q * q / (q * q).sum() for q in rows]
        path, bonus = verify_sampling(tree, t.target_rows(tree), torch.stack([torch.zeros_like(rows[0]), *told]), None)
        return committed(t, tree, path, bonus, n, oracle)
    return run


def dflash_tree(depth: int, size: int, k: int, n: int, deterministic: bool = True):
    """decoder=dflash's tree (DDTree's: the `size` most probable paths of the rows' top-k, built by the
    production ddtree): nothing drawn, verified as deterministic candidates. deterministic=False:
    verified as if each node had been drawn from its position's row (wrong)."""
    def run(oracle, t):
        rows = torch.stack(block_rows(t, depth))
        top, ids = rows.topk(k, -1)
        tree = ddtree(0, top, ids, size)
        draft_probs = None if deterministic else torch.stack(
            [torch.zeros_like(rows[0])] + [rows[tree.depths[c] - 1] for c in range(1, len(tree))])
        path, bonus = verify_sampling(tree, t.target_rows(tree), draft_probs, None)
        return committed(t, tree, path, bonus, n, oracle)
    return run


# Deterministic candidates (lookahead n-grams, BPD / Medusa heads): fixed trees, point-mass drafts,
# with duplicate tokens among siblings and across depths.
DETERMINISTIC_TREES = {
    "dup_siblings": TokenTree([0, 1, 1, 2, 1, 3, 1, 0, 2, 2], [-1, 0, 0, 0, 1, 1, 2, 3, 3, 3]),
    "ngram_trie": TokenTree.from_sequences(0, [[1, 2, 3], [1, 2, 0], [2, 2, 2], [3], [1, 0]]),
    "repeated_chain": TokenTree.chain(2, [2, 2, 2]),
    "every_token_and_a_dup": TokenTree([0, 3, 0, 1, 2, 3, 1], [-1, 0, 0, 0, 0, 0, 1]),
}


def deterministic(tree: TokenTree, n: int):
    def run(oracle, t):
        path, bonus = verify_sampling(tree, t.target_rows(tree), None, None)
        return committed(t, tree, path, bonus, n, oracle)
    return run


def max_error(run, n: int, V: int, seeds) -> float:
    """Max over random (p, q) tables of the L1 distance between the exact distribution of the
    first n committed tokens and the target's."""
    worst = 0.0
    for seed in seeds:
        t = Tables(seed, V)
        worst = max(worst, l1(exact_distribution(lambda oracle: run(oracle, t)), t.joint(n)))
    return worst


# ---- lossless: exact equality -------------------------------------------------------------------
CORRECT = {
    # name: (run, committed tokens compared, vocabulary, seeds)
    "chain-1": (spec_chain(1, 2), 2, 5, range(40)),
    "chain-3": (spec_chain(3, 2), 2, 4, range(20)),
    "specinfer-k2-d1": (specinfer(2, 1, 1), 1, 5, range(60)),
    "specinfer-k3-d1": (specinfer(3, 1, 1), 1, 5, range(40)),
    "specinfer-k2-d2": (specinfer(2, 2, 2), 2, 4, range(12)),
    "specinfer-k3-d2": (specinfer(3, 2, 2), 2, 4, range(2)),  # 4096 draft outcomes per pair
    "sequoia-2": (sequoia([-1, 0, 0], 1), 1, 5, range(60)),
    "sequoia-3": (sequoia([-1, 0, 0, 0], 1), 1, 4, range(40)),
    "sequoia-2-2-1": (sequoia([-1, 0, 0, 1, 1, 2], 2), 2, 4, range(6)),
    **{f"deterministic-{name}": (deterministic(tree, 2), 2, 4, range(40))
       for name, tree in DETERMINISTIC_TREES.items()},
    "dflash-chain-2": (dflash_chain(2, 2), 2, 4, range(30)),
    "dflash-chain-3": (dflash_chain(3, 2), 2, 4, range(10)),
    "dflash-tree-5-of-3x2": (dflash_tree(3, 5, 2, 2), 2, 4, range(40)),
    "dflash-tree-3-of-2x3": (dflash_tree(2, 3, 3, 2), 2, 5, range(40)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CORRECT)
def test_exact_distribution_equals_target(case):
    run, n, V, seeds = CORRECT[case]
    assert max_error(run, n, V, seeds) < EXACT


# ---- negative controls: the same check catches wrong verification -------------------------------
def _no_residual(p, q):
    return p  # WRONG: the target's distribution is not updated after a rejection


def _unnormalised_residual(p, q):
    r = torch.clamp(p - q, min=0)
    return r if r.sum() > 0 else p  # WRONG: not renormalised, so later ratio tests see too small a p


WRONG = {
    # name: (run, committed tokens, vocabulary, seeds, residual replacing decoders.core.verify.residual)
    "specinfer-k2-merged-duplicates": (specinfer(2, 1, 1, keep_draws=False), 1, 4, range(40), None),
    "specinfer-k3-merged-duplicates": (specinfer(3, 1, 1, keep_draws=False), 1, 4, range(20), None),
    "specinfer-k2-d2-merged-duplicates": (specinfer(2, 2, 2, keep_draws=False), 2, 4, range(3), None),
    "sequoia-verified-as-iid": (sequoia([-1, 0, 0, 0], 1, without_replacement=False), 1, 4, range(20), None),
    "chain-no-residual": (spec_chain(1, 1), 1, 4, range(20), _no_residual),
    "specinfer-k3-no-residual": (specinfer(3, 1, 1), 1, 4, range(20), _no_residual),
    "specinfer-k3-unnormalised-residual": (specinfer(3, 1, 1), 1, 4, range(20), _unnormalised_residual),
    "sequoia-unnormalised-residual": (sequoia([-1, 0, 0, 0], 1), 1, 4, range(20), _unnormalised_residual),
    "deterministic-no-residual": (deterministic(DETERMINISTIC_TREES["dup_siblings"], 1), 1, 4, range(20),
                                  _no_residual),
    "dflash-chain-verified-against-other-rows": (dflash_chain(2, 1, drawn_rows=False), 1, 4, range(20), None),
    "dflash-tree-verified-as-drawn": (dflash_tree(2, 3, 2, 1, deterministic=False), 1, 4, range(20), None),
    "dflash-chain-no-residual": (dflash_chain(2, 1), 1, 4, range(20), _no_residual),
}


@pytest.mark.parametrize("case", WRONG)
def test_negative_control_is_detected(monkeypatch, case):
    run, n, V, seeds, wrong_residual = WRONG[case]
    if wrong_residual is not None:
        monkeypatch.setattr(verify_module, "residual", wrong_residual)
    assert max_error(run, n, V, seeds) > DETECT


# ---- end to end: SpecInfer hands verify_sampling its draws ------------------------------------
def test_specinfer_passes_draws_in_draw_order_with_duplicates(monkeypatch):
    """top_k=2 leaves the draft two tokens, so k=4 chains always repeat a first token; every
    verify_sampling call must get, per trie node, one entry per chain through it, in chain
    order, each naming the trie child that holds the chain's next token."""
    k, depth = 4, 2
    dtrees, calls = [], []
    real_draft_tree, real_verify = specinfer_module.draft_tree, loop_module.verify_sampling

    def recording_draft_tree(*args, **kwargs):
        dtrees.append(real_draft_tree(*args, **kwargs))
        return dtrees[-1]

    def recording_verify(tree, *args, draws=None, **kwargs):
        calls.append((tree, draws))
        return real_verify(tree, *args, draws=draws, **kwargs)

    monkeypatch.setattr(specinfer_module, "draft_tree", recording_draft_tree)
    monkeypatch.setattr(loop_module, "verify_sampling", recording_verify)
    lm = tiny_lm(seed=0, layers=3)
    SpecInfer(draft=SelfDraft(layers=1), num_drafts=k, depth=depth).generate(lm, [1, 2, 3, 4], 12,
                                                                   Sampling(temperature=1.0, top_k=2, seed=0), set())
    calls = calls[1:]  # the first step is the prefill: the root alone, one target token
    assert calls and len(calls) == len(dtrees)
    for (tree, draws), dtree in zip(calls, dtrees):
        assert draws is not None and len(draws) == len(tree)
        assert len(draws[0]) == k and len(set(draws[0])) < k  # duplicates kept
        sequences = [[dtree.tokens[i], dtree.tokens[i + k]] for i in range(1, k + 1)]  # chains(k, 2) layout
        walked = []
        for j in range(k):  # chain j is the j-th draw at every node its prefix leads to
            node, seq = 0, []
            for _ in range(depth):
                nth = sum(1 for s in sequences[:j] if s[:len(seq)] == seq)
                child = draws[node][nth]
                assert child in tree.children[node]
                seq.append(tree.tokens[child])
                node = child
            walked.append(seq)
        assert walked == sequences
        assert sum(map(len, draws)) == k * depth
