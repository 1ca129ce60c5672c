"""Tree verification.

Greedy: hand-made logits with a known answer. Sampling: verify_sampling must be lossless,
i.e. the committed tokens (the accepted path's tokens after the root, then the bonus token)
are distributed exactly as autoregressive sampling from the target. That is checked with a
chi-square goodness-of-fit test against the EXACT distribution (p-value threshold 1e-3, fixed
seeds, so every run is the same run), in all three modes: deterministic candidates
(draft_probs=None), siblings drawn independently from q (SpecInfer), and siblings drawn from q
without replacement (Sequoia). Negative controls show the same test rejects wrong verifiers.
"""
from __future__ import annotations

import math

import pytest
import torch

import decoders.core.verify as verify_module
from decoders.core import transfer
from decoders.core.tree import TokenTree
from decoders.core.verify import verify_greedy, verify_sampling
from helpers import chi2_pvalue, first_quick

ALPHA = 1e-3


# ---- the chi-square helper (tests/helpers.py) ---------------------------------------------
def test_chi2_pvalue_helper():
    # df = 2: the chi-square survival function is exp(-x / 2).
    counts = torch.tensor([130.0, 100.0, 70.0])
    stat = (30 ** 2 + 0 + 30 ** 2) / 100
    assert (chi2_pvalue(counts, torch.full((3,), 1 / 3, dtype=torch.float64))
            == pytest.approx(math.exp(-stat / 2), rel=1e-9))
    # df = 1: the two rare cells (expected 2 and 2) form one bin of expected 4 < 5, which is
    # merged into the smallest other bin; sf(x) = erfc(sqrt(x / 2)).
    counts = torch.tensor([490.0, 502.0, 3.0, 5.0])
    p = torch.tensor([0.496, 0.500, 0.002, 0.002], dtype=torch.float64)
    stat = 2 ** 2 / 500 + 2 ** 2 / 500  # bins (490 + 3 + 5 vs 496 + 4) and (502 vs 500)
    assert chi2_pvalue(counts, p) == pytest.approx(math.erfc(math.sqrt(stat / 2)), rel=1e-6)
    # an observation where the expected probability is 0 is a certain rejection
    assert chi2_pvalue(torch.tensor([5.0, 5.0, 1.0]), torch.tensor([0.5, 0.5, 0.0])) == 0.0
    # a perfect fit
    assert chi2_pvalue(torch.tensor([250.0, 750.0]), torch.tensor([0.25, 0.75])) == pytest.approx(1.0)


# ---- greedy -------------------------------------------------------------------------------
def _logits(n: int, V: int, argmax: list[int]) -> torch.Tensor:
    """(n, V) logits whose row i has its maximum at argmax[i] (and noise elsewhere)."""
    g = torch.Generator().manual_seed(n * 131 + V)
    logits = torch.randn(n, V, generator=g)
    for i, a in enumerate(argmax):
        logits[i, a] = logits[i].max() + 1.0
    return logits


def test_greedy_chain_partial_accept():
    tree = TokenTree.chain(9, [4, 2, 7])
    # after root -> 4 (match), after 4 -> 2 (match), after 2 -> 5 (draft 7 rejected), after 7 -> 1
    path, bonus = verify_greedy(tree, _logits(4, 10, [4, 2, 5, 1]))
    assert (path, bonus) == ([0, 1, 2], 5)


def test_greedy_chain_full_accept_and_bonus():
    tree = TokenTree.chain(9, [4, 2, 7])
    path, bonus = verify_greedy(tree, _logits(4, 10, [4, 2, 7, 3]))
    assert (path, bonus) == ([0, 1, 2, 3], 3)


def test_greedy_chain_first_draft_rejected():
    tree = TokenTree.chain(9, [4, 2, 7])
    path, bonus = verify_greedy(tree, _logits(4, 10, [6, 2, 7, 3]))
    assert (path, bonus) == ([0], 6)


def test_greedy_branching_tree():
    #            0 (root 9)
    #     1(3)     2(5)      3(8)
    #   4(1) 5(6)  6(6)      7(2)
    #        8(0)
    tree = TokenTree([9, 3, 5, 8, 1, 6, 6, 2, 0], [-1, 0, 0, 0, 1, 1, 2, 3, 5])
    #                 root, n1, n2, n3, n4, n5, n6, n7, n8
    argmax = [5, 6, 6, 2, 0, 0, 4, 7, 4]
    # root -> 5 (node 2), node 2 -> 6 (node 6), node 6 -> 4: no child, bonus 4
    assert verify_greedy(tree, _logits(9, 10, argmax)) == ([0, 2, 6], 4)
    argmax = [3, 6, 6, 2, 0, 0, 4, 7, 4]
    # root -> 3 (node 1), node 1 -> 6 (node 5), node 5 -> 0 (node 8), node 8 -> 4
    assert verify_greedy(tree, _logits(9, 10, argmax)) == ([0, 1, 5, 8], 4)
    argmax = [8, 6, 6, 2, 0, 0, 4, 7, 4]
    # root -> 8 (node 3), node 3 -> 2 (node 7), node 7 -> 7: leaf, bonus 7
    assert verify_greedy(tree, _logits(9, 10, argmax)) == ([0, 3, 7], 7)


def test_greedy_nothing_matches():
    tree = TokenTree([9, 3, 5, 8, 1], [-1, 0, 0, 0, 1])
    assert verify_greedy(tree, _logits(5, 10, [7, 1, 0, 0, 0])) == ([0], 7)


def test_greedy_duplicate_siblings():
    # Root children 1 and 2 both hold token 3; node 3 (token 4) hangs under node 1. A
    # duplicate shares its twin's context, so both rows of target logits are the same.
    tree = TokenTree([9, 3, 3, 4], [-1, 0, 0, 1])
    logits = _logits(4, 10, [3, 4, 4, 6])
    logits[2] = logits[1]
    assert verify_greedy(tree, logits) == ([0, 1, 3], 6)
    # nothing under the duplicates matches: one of them is accepted, and the bonus is the
    # argmax after it (the same for both twins)
    logits = _logits(4, 10, [3, 5, 5, 6])
    logits[2] = logits[1]
    path, bonus = verify_greedy(tree, logits)
    assert path in ([0, 1], [0, 2]) and bonus == 5


def test_greedy_duplicate_siblings_take_the_deeper_match():
    # The deeper match runs through the SECOND twin (node 2 -> node 3): it must win.
    tree = TokenTree([9, 3, 3, 4], [-1, 0, 0, 2])
    logits = _logits(4, 10, [3, 4, 4, 6])
    logits[2] = logits[1]
    assert verify_greedy(tree, logits) == ([0, 2, 3], 6)


def test_greedy_ties_take_first_index():
    tree = TokenTree.chain(0, [2])
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5], [3.0, 3.0, 3.0, 3.0]])
    # root's argmax is 1 (first of the tie 1/2), so draft 2 is rejected
    assert verify_greedy(tree, logits) == ([0], 1)
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5], [3.0, 3.0, 3.0, 3.0]])
    assert verify_greedy(tree, logits) == ([0, 1], 0)


# ---- sampling: first committed token --------------------------------------------------------
V1 = 5
P_FIRST = torch.tensor([0.30, 0.05, 0.00, 0.40, 0.25], dtype=torch.float32)  # token 2 impossible (as top-p leaves it)
Q_FIRST = torch.tensor([0.10, 0.35, 0.20, 0.05, 0.30], dtype=torch.float32)  # full support, unlike p
N_FIRST = 20_000
N_CONTROL = 10_000  # the wrong verifiers are far off: fewer trials suffice to reject them


def _committed(tree: TokenTree, path: list[int], bonus: int) -> list[int]:
    return [tree.tokens[i] for i in path[1:]] + [bonus]


def _first_token_counts(children: torch.Tensor, draft: bool, without_replacement: bool, seed: int,
                        verifier=verify_sampling) -> torch.Tensor:
    """children: (N, k) tokens of the root's children per trial. Depth-1 trees (root + k children)."""
    N, k = children.shape
    parents = [-1] + [0] * k
    target = P_FIRST.expand(k + 1, V1)
    draft_probs = Q_FIRST.expand(k + 1, V1) if draft else None
    g = torch.Generator().manual_seed(seed)
    counts = [0] * V1
    for row in children.tolist():
        tree = TokenTree([0, *row], parents)
        path, bonus = verifier(tree, target, draft_probs, g, without_replacement)
        counts[_committed(tree, path, bonus)[0]] += 1
    return torch.tensor(counts, dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("candidates", [[3], [1, 3], [3, 2, 3], [4, 3, 2, 1, 0]],
                         ids=["one", "two", "three_impossible_and_dup", "all_tokens"])
def test_first_token_deterministic_candidates(candidates):
    children = torch.tensor(candidates).expand(N_FIRST, len(candidates))
    counts = _first_token_counts(children, draft=False, without_replacement=False, seed=len(candidates))
    assert counts[2] == 0  # zero target probability: never committed
    p = chi2_pvalue(counts, P_FIRST)
    assert p > ALPHA, (counts / N_FIRST, P_FIRST, p)


@pytest.mark.slow
@pytest.mark.parametrize("replacement,k", [(True, 1), (True, 3), (False, 2), (False, 5)],
                         ids=["iid-1", "iid-3", "without_replacement-2", "without_replacement-5"])
def test_first_token_drafted(replacement, k):
    base = 100 if replacement else 300
    g = torch.Generator().manual_seed(base + k)
    children = torch.multinomial(Q_FIRST.expand(N_FIRST, V1), k, replacement=replacement, generator=g)
    counts = _first_token_counts(children, draft=True, without_replacement=not replacement, seed=base + 100 + k)
    p = chi2_pvalue(counts, P_FIRST)
    assert p > ALPHA, (counts / N_FIRST, P_FIRST, p)


# ---- sampling: joint of the first two committed tokens on depth-2 trees ---------------------
V2 = 4
N_JOINT = 20_000


def _random_rows(g: torch.Generator, shape, zero_some: bool) -> torch.Tensor:
    """Random distributions over V2 (last dim); with zero_some, one entry of every other row is
    zeroed (the target after top-p / top-k), never all of them."""
    w = torch.rand(*shape, V2, generator=g, dtype=torch.float64) ** 2 + 0.02
    if zero_some:
        flat = w.reshape(-1, V2)
        idx = torch.randint(0, V2, (flat.shape[0],), generator=g)
        for r in range(0, flat.shape[0], 2):
            flat[r, idx[r]] = 0
    return (w / w.sum(-1, keepdim=True)).float()


def _tables(seed: int):
    """Target p(.|prefix) and draft q(.|prefix) for prefixes of length <= 2, keyed by tuple.
    The target tables are also returned stacked (P0 (V,), P1 (V,V), P2 (V,V,V)) for indexing."""
    g = torch.Generator().manual_seed(seed)
    P0 = _random_rows(g, (), zero_some=False)
    P1 = _random_rows(g, (V2,), zero_some=True)
    P2 = _random_rows(g, (V2, V2), zero_some=True)
    Q0 = _random_rows(g, (), zero_some=False)
    Q1 = _random_rows(g, (V2,), zero_some=False)  # full support: without replacement needs k <= support
    p = {(): P0}
    p.update({(a,): P1[a] for a in range(V2)})
    p.update({(a, b): P2[a, b] for a in range(V2) for b in range(V2)})
    q = {(): Q0}
    q.update({(a,): Q1[a] for a in range(V2)})
    return p, q, (P0, P1, P2), (Q0, Q1)


def _depth2_trials(mode: str, k1: int, k2: int, seed: int, wrong_rows: bool = False, N: int = N_JOINT):
    """Build N depth-2 trees (root, k1 children, k2 grandchildren under each child) and
    return counts (V, V) of the first two committed tokens, plus the exact joint."""
    p_table, q_table, (P0, P1, P2), (Q0, Q1) = _tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    replacement = mode != "without"
    X1 = torch.multinomial(Q0.expand(N, V2), k1, replacement=replacement, generator=g)  # (N, k1)
    X2 = torch.multinomial(Q1[X1].reshape(N * k1, V2), k2, replacement=replacement, generator=g).reshape(N, k1, k2)
    parents = [-1] + [0] * k1 + [1 + i for i in range(k1) for _ in range(k2)]
    n = len(parents)
    tokens = torch.cat([torch.zeros(N, 1, dtype=torch.long), X1, X2.reshape(N, k1 * k2)], dim=1)
    # target_probs[node] = p(.| path prefix of node); draft_probs[node] = q(.| parent's prefix)
    target = torch.cat([P0.expand(N, 1, V2),
                        (P0.expand(N, k1, V2) if wrong_rows else P1[X1]),
                        P2[X1[:, :, None].expand(N, k1, k2), X2].reshape(N, k1 * k2, V2)], dim=1)
    draft = torch.cat([Q0.expand(N, 1 + k1, V2), Q1[X1][:, :, None, :].expand(N, k1, k2, V2).reshape(N, k1 * k2, V2)],
                      dim=1)
    assert target.shape == draft.shape == (N, n, V2)
    # spot-check the vectorised tables against the dict definition on one trial
    t0 = tokens[0].tolist()
    for node in range(n):
        prefix = tuple(t0[i] for i in TokenTree(t0, parents).path(node)[1:])
        if not wrong_rows:
            assert torch.equal(target[0, node], p_table[prefix])
        assert torch.equal(draft[0, node], q_table[prefix[:-1]] if node else q_table[()])

    # Fewer than two committed: the next decoding step samples x2 from the target after x1.
    # Drawn up front for every possible x1 (independent of the verification's randomness).
    next_step = torch.multinomial(P1, N, replacement=True, generator=g).T.tolist()  # [t][x1]
    counts = [[0] * V2 for _ in range(V2)]
    for t, toks in enumerate(tokens.tolist()):
        tree = TokenTree(toks, parents)
        path, bonus = verify_sampling(tree, target[t], None if mode == "deterministic" else draft[t], g,
                                      without_replacement=(mode == "without"))
        committed = _committed(tree, path, bonus)
        x1 = committed[0]
        x2 = committed[1] if len(committed) >= 2 else next_step[t][x1]
        counts[x1][x2] += 1
    counts = torch.tensor(counts, dtype=torch.float64)
    joint = P0[:, None].double() * P1.double()
    return counts, joint


@pytest.fixture(params=[False, True], ids=["walk", "read_at_once"])
def one_read(request, monkeypatch):
    """Both ways verify_sampling runs: the CPU's walk, and the device's (one read a step), turned on here."""
    monkeypatch.setattr(transfer, "reads_wait", lambda device: request.param)
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("mode,k1,k2", [("deterministic", 3, 2), ("iid", 3, 2), ("iid", 1, 1), ("without", 3, 2)])
def test_joint_first_two_tokens(mode, k1, k2, one_read):
    counts, joint = _depth2_trials(mode, k1, k2, seed=1000 + 10 * k1 + k2)
    assert counts.sum() == N_JOINT
    assert counts[joint == 0].sum() == 0  # pairs the target cannot produce never appear
    p = chi2_pvalue(counts, joint)
    assert p > ALPHA, (mode, counts / N_JOINT, joint, p)


# ---- negative controls: the same tests reject wrong verifiers --------------------------------
def _accept_every_draft(tree, target_probs, draft_probs, generator, without_replacement=False):
    """WRONG: accept the first child at every node without the ratio test."""
    node, path = 0, [0]
    while tree.children[node]:
        node = tree.children[node][0]
        path.append(node)
    return path, int(torch.multinomial(target_probs[node], 1, generator=generator))


def _no_residual(tree, target_probs, draft_probs, generator, without_replacement=False):
    """WRONG: the ratio test is right, but after rejecting every child the next token is drawn
    from the target p itself instead of the residual norm(max(p - q, 0))."""
    node, path = 0, [0]
    while True:
        p = target_probs[node]
        for child in tree.children[node]:
            x = tree.tokens[child]
            if torch.rand((), generator=generator) * draft_probs[child][x] < p[x]:
                break
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(child)
        node = child


def test_negative_control_accept_every_draft_is_rejected():
    g = torch.Generator().manual_seed(7)
    children = torch.multinomial(Q_FIRST.expand(N_CONTROL, V1), 2, replacement=True, generator=g)
    counts = _first_token_counts(children, draft=True, without_replacement=False, seed=8, verifier=_accept_every_draft)
    assert chi2_pvalue(counts, P_FIRST) < ALPHA
    # and still rejected when the impossible token is left out of the picture (power comes
    # from the shape of the distribution, not only from the zero cell)
    keep = torch.tensor([0, 1, 3, 4])
    assert chi2_pvalue(counts[keep], P_FIRST[keep] / P_FIRST[keep].sum()) < ALPHA


@pytest.mark.parametrize("mode", first_quick(["iid", "deterministic", "without"]))
def test_negative_control_read_at_once_without_residual_is_rejected(mode, monkeypatch):
    """The device's way, with the target's distribution left as it was after a rejection: the joint test sees it."""
    monkeypatch.setattr(transfer, "reads_wait", lambda device: True)
    monkeypatch.setattr(verify_module, "residual", lambda p, q: p)
    counts, joint = _depth2_trials(mode, 3, 2, seed=3000, N=N_CONTROL)
    assert chi2_pvalue(counts, joint) < ALPHA


class HostReads:
    """Counts a tensor's reads into Python (each makes the host wait for a GPU): tolist, item, numpy and
    the conversions to bool, int and float, as `with HostReads(monkeypatch) as reads:` in the block."""
    METHODS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)

            def counted(tensor, *args, _real=real, **kwargs):
                self.count += 1
                return _real(tensor, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("mode", ["deterministic", "iid", "without"])
def test_sampled_tree_verification_reads_the_device_once(mode, monkeypatch):
    """Where each read makes the host wait (turned on here, on a CPU), verifying a sampled tree reads once a
    step, whatever the tree (a 31-node tree of 5 children a node, 2 levels deep, and a chain), not once or more
    a node; on a CPU the walk reads what it reaches."""
    g = torch.Generator().manual_seed(5)
    V = 6
    for parents in ([-1] + [0] * 5 + [1 + i // 5 for i in range(25)], [-1, 0, 1, 2, 3, 4]):
        tokens = [0] * len(parents)
        for node, children in enumerate(TokenTree(tokens, parents).children):  # siblings differ: drawn without
            for child, token in zip(children, torch.randperm(V, generator=g).tolist()):  # replacement
                tokens[child] = token
        tree = TokenTree(tokens, parents)
        target = torch.softmax(torch.randn(len(tree), V, generator=g), -1)
        draft = None if mode == "deterministic" else torch.full((len(tree), V), 1 / V)
        for wait in (True, False):
            monkeypatch.setattr(transfer, "reads_wait", lambda device: wait)
            reads = HostReads(monkeypatch)
            for seed in range(20):
                path, bonus = verify_sampling(tree, target, draft, torch.Generator().manual_seed(seed),
                                              without_replacement=mode == "without")
                assert 0 <= bonus < V and path[0] == 0
            monkeypatch.undo()
            assert (reads.count == 20) if wait else reads.count > 20, (wait, reads.count)


def test_negative_control_no_residual_is_rejected():
    g = torch.Generator().manual_seed(9)
    children = torch.multinomial(Q_FIRST.expand(N_CONTROL, V1), 1, replacement=True, generator=g)
    counts = _first_token_counts(children, draft=True, without_replacement=False, seed=10, verifier=_no_residual)
    assert counts[2] == 0  # the ratio test alone never lets the impossible token through
    assert chi2_pvalue(counts, P_FIRST) < ALPHA


def test_negative_control_without_replacement_drafts_verified_as_iid_are_rejected():
    """Sequoia drafts verified with the with-replacement rule (q not updated after a rejection)
    are biased; the test detects it."""
    g = torch.Generator().manual_seed(11)
    children = torch.multinomial(Q_FIRST.expand(N_CONTROL, V1), 3, replacement=False, generator=g)
    counts = _first_token_counts(children, draft=True, without_replacement=False, seed=12)
    assert counts[2] == 0
    assert chi2_pvalue(counts, P_FIRST) < ALPHA


@pytest.mark.slow
def test_negative_control_joint_detects_misaligned_target_rows():
    """Children given the root's target row (the classic off-by-one between nodes and target
    logits rows): the first token is still right, the pair is not, and the joint test sees it."""
    counts, joint = _depth2_trials("iid", 3, 2, seed=2000, wrong_rows=True, N=N_CONTROL)
    assert chi2_pvalue(counts.sum(1), joint.sum(1)) > ALPHA  # x1 alone is unaffected
    assert chi2_pvalue(counts, joint) < ALPHA
    # rejected on the shape too, not only because pairs the target cannot produce show up
    possible = joint > 0
    assert chi2_pvalue(counts[possible], joint[possible] / joint[possible].sum()) < ALPHA


# ---- invalid input ---------------------------------------------------------------------------
def test_zero_draft_probability_raises():
    tree = TokenTree([0, 2, 1], [-1, 0, 0])
    target = torch.full((3, 4), 0.25)
    draft = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(3, 4)  # token 2 could not have been drafted
    with pytest.raises(ValueError, match="node 1 holds token 2"):
        verify_sampling(tree, target, draft, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="node 1 holds token 2"):
        verify_sampling(tree, target, draft, torch.Generator().manual_seed(0), without_replacement=True)


def test_without_replacement_duplicate_sibling_raises():
    # a duplicate sibling cannot come from draws without replacement: once its twin is rejected
    # the running draft distribution gives it probability 0
    tree = TokenTree([0, 2, 2], [-1, 0, 0])
    target = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(3, 4)  # p(2) = 0: node 1 is always rejected
    draft = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="node 2 holds token 2"):
        verify_sampling(tree, target, draft, torch.Generator().manual_seed(0), without_replacement=True)
    # with replacement the same tree is legal
    path, bonus = verify_sampling(tree, target, draft, torch.Generator().manual_seed(0))
    assert path == [0] and bonus in (0, 1)


def test_deterministic_candidates_with_zero_target_probability_do_not_raise():
    tree = TokenTree([0, 2, 3], [-1, 0, 0])
    target = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(3, 4)
    for seed in range(20):
        path, bonus = verify_sampling(tree, target, None, torch.Generator().manual_seed(seed))
        assert path == [0] and bonus in (0, 1)


def test_zero_target_probability_token_never_accepted_even_when_u_is_zero(monkeypatch):
    """A token the target gives probability 0 (outside top-p / top-k) must never be committed.
    torch.rand draws from [0, 1) and does return exactly 0.0 (rate 2**-24 for float32; e.g.
    draw number 41,102,971 of torch.Generator().manual_seed(0) on CPU), so the acceptance test
    must be strict: u * q(x) < p(x), not <=. Here the uniform draw is forced to that value."""
    real_rand = torch.rand

    def rand_zero(*args, **kwargs):
        return torch.zeros_like(real_rand(*args, **kwargs))

    monkeypatch.setattr(torch, "rand", rand_zero)
    target = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(2, 4)
    tree = TokenTree([0, 2], [-1, 0])
    g = torch.Generator().manual_seed(0)
    for draft in (None, torch.full((2, 4), 0.25)):
        path, bonus = verify_sampling(tree, target, draft, g)
        assert path == [0], f"token 2 has target probability 0 but was accepted (draft_probs={draft})"
        assert bonus in (0, 1)


def test_greedy_on_cpu_reads_only_the_rows_it_reaches_and_agrees_with_every_row(monkeypatch):
    """On a CPU verify_greedy takes the argmax of the rows its walk reaches, not of every tree row.
    Against the all-rows walk, on random trees whose logits tie often (a few integer values): the
    same path and bonus (argmax's first index wins ties either way), from fewer rows."""
    import random

    def all_rows(tree, logits):
        prediction = torch.argmax(logits, dim=-1).tolist()

        def longest(node):
            best = []
            for child in tree.children[node]:
                if tree.tokens[child] == prediction[node]:
                    below = longest(child)
                    if len(below) + 1 > len(best):
                        best = [child] + below
            return best
        path = [0] + longest(0)
        return path, prediction[path[-1]]

    from decoders.core import sampling

    rng = random.Random(0)
    real_argmax, read = sampling.argmax, []

    def counting(x):  # every read of a row goes through sampling.argmax (on a CPU numpy's, not torch's)
        read.append(x.shape[0] if x.dim() > 1 else 1)
        return real_argmax(x)

    fewer = 0
    for _ in range(300):
        n = rng.randint(1, 30)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tree = TokenTree([rng.randrange(4) for _ in range(n)], parents)
        logits = torch.randint(0, 3, (n, 4)).float()
        expected = all_rows(tree, logits)
        read.clear()
        monkeypatch.setattr(sampling, "argmax", counting)
        got = verify_greedy(tree, logits)
        monkeypatch.undo()
        assert got == expected, (parents, tree.tokens, logits)
        assert read  # the count sees the reads
        fewer += sum(read) < n
    assert fewer > 100  # most walks stop well before the last row


def test_rows_read_already_give_the_same_path_as_reading_them():
    """On a GPU the loop reads every row's argmax once (loop.Scores.argmax) and hands them to
    verify_greedy, which then reads nothing: the same path and bonus as its own reads."""
    import random

    from decoders.core.loop import Scores
    from decoders.core.sampling import argmax

    rng = random.Random(1)
    for _ in range(200):
        n, s = rng.randint(1, 20), rng.randint(0, 4)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tree = TokenTree([rng.randrange(4) for _ in range(n)], parents)
        rows = torch.randint(0, 3, (n + s, 4)).float()  # the tree's rows, then a side branch's
        scores = Scores(rows[:n], rows[n:], rows=rows)
        assert verify_greedy(tree, scores.logits, argmax(rows)) == verify_greedy(tree, scores.logits)
        assert scores.argmax() == argmax(rows) and scores.argmax(n) == argmax(rows[n:])


def test_top_rows_ride_with_the_argmax_read_on_a_gpu(monkeypatch):
    """A proposal asking for each row's top-k (Token Recycling's successors) gets them in the argmax's
    read where rows are read at once (a GPU, stood for here by rows marked off the host): one read for
    verification and the commit, the same tokens as reading each alone; the control, without top_k,
    reads a second time."""
    from decoders.core import sampling
    from decoders.core.loop import Scores
    from decoders.core.sampling import argmax

    rows = torch.randint(0, 5, (7, 12)).float()  # ties, so argmax's first index is checked too
    reads, real, real_argmax = [], torch.Tensor.tolist, sampling.argmax
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))  # a read of a tensor
    monkeypatch.setattr(sampling, "argmax", lambda t, *maxima: reads.append(t.shape) or real_argmax(t, *maxima))

    def read_both(top_k):
        scores = Scores(rows, top_k=top_k)
        scores.argmax_rows().on_host = False
        reads.clear()
        got = scores.argmax(), (scores.top() if top_k else torch.topk(rows, 3).indices.tolist())
        return got, len(reads)

    (predicted, top), count = read_both(3)
    assert count == 1 and predicted == argmax(rows) and top == torch.topk(rows, 3).indices.tolist()
    assert read_both(0)[1] == 2
    assert Scores(rows, top_k=3).top() == top and Scores(rows, top_k=99).top() == torch.topk(rows, 12).indices.tolist()
