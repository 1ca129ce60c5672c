"""Sequoia's tree DP against brute force over every tree, the hardware-aware choice against
brute force over its grid (and over every tree where the DP's optimum must be the global one),
and the acceptance-vector measurement on tiny models."""
import functools
import itertools
import json
import random
import time

import pytest
import torch

from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.draft_model import new_exit_adapter, self_draft_model
from decoders.core.lm import LM
from decoders.core.sampling import Sampling
from decoders.tuning.sequoia_acceptance import (
    _sampled_rank, acceptance_counts, cached_acceptance, device_latency, load_acceptance, measure_acceptance,
    model_fingerprint, profile_latency, save_acceptance,
)
from decoders.tuning.sequoia_tree import (TreeShape, _tables, choose_tree, expected_tokens, optimal_tree,
                                          predicted_time_per_token)
from decoders.core.tree import TokenTree
from helpers import SESSION_TOKENIZER, chi2_pvalue, tiny_lm
from test_scripts import run_script


# ---- brute force over all trees -------------------------------------------------------
@functools.lru_cache(maxsize=None)
def all_trees(n: int, depth: int, K: int) -> tuple:
    """Every rooted ordered tree of exactly n nodes, depth <= depth, <= K children per node, as
    nested tuples of children in rank order."""
    if n == 1:
        return ((),)
    if depth == 0:
        return ()
    return all_forests(n - 1, depth - 1, K, K)


@functools.lru_cache(maxsize=None)
def all_forests(m: int, depth: int, slots: int, K: int) -> tuple:
    """Ordered sequences of at most `slots` trees (each of depth <= depth) with m nodes in all."""
    if m == 0:
        return ((),)
    if slots == 0:
        return ()
    return tuple((first, *rest) for j in range(1, m + 1) for first in all_trees(j, depth, K)
                 for rest in all_forests(m - j, depth, slots - 1, K))


def enumerate_trees(max_nodes: int, depth: int, K: int) -> list[tuple]:
    return [t for n in range(1, max_nodes + 1) for t in all_trees(n, depth, K)]


def value(tree: tuple, p) -> float:
    return 1.0 + sum(p[k] * value(child, p) for k, child in enumerate(tree))


def size(tree: tuple) -> int:
    return 1 + sum(size(c) for c in tree)


def tree_depth(tree: tuple) -> int:
    return 1 + max(tree_depth(c) for c in tree) if tree else 0


def nested(parents) -> tuple:
    kids = [[] for _ in parents]
    for i, parent in enumerate(parents[1:], start=1):
        kids[parent].append(i)

    def build(i):
        return tuple(build(c) for c in kids[i])
    return build(0)


def random_acceptance(seed: int, K: int) -> list[float]:
    rng = random.Random(seed)
    raw = [rng.random() for _ in range(K)]
    if seed % 3 == 1:
        raw[rng.randrange(K)] = 0.0  # a zero creates ties: extra nodes that add nothing
    if seed % 3 != 2:
        raw.sort(reverse=True)  # measured vectors decrease; the DP must not rely on it
    total = rng.uniform(0.3, 1.0)
    s = sum(raw) or 1.0
    return [x * total / s for x in raw]


def check_shape(shape: TreeShape, K: int, budget: int, max_depth: int) -> None:
    parents = list(shape.parents)
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, len(parents)))
    assert shape.size <= budget + 1 and shape.budget == shape.size - 1
    depths = TokenTree([0] * shape.size, parents).depths
    assert depths == shape.depths() and shape.depth == max(depths) <= max_depth
    assert depths == sorted(depths), "nodes are in BFS (level) order"
    assert shape.children() == TokenTree([0] * shape.size, parents).children
    for kids in shape.children():
        assert kids == list(range(kids[0] if kids else 0,
                                  (kids[0] if kids else 0) + len(kids))), "siblings are consecutive"
        assert len(kids) <= K
    # BFS: a node's children come after those of every node before it
    firsts = [kids[0] for kids in shape.children() if kids]
    assert firsts == sorted(firsts)
    ranks = shape.ranks()
    assert ranks[0] == 0 and all(ranks[k] == 1 + kids.index(k) for kids in shape.children() for k in kids)
    assert shape.level_widths() == [depths.count(d) for d in range(shape.depth + 1)]


# ---- the DP ---------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force_over_all_trees(K, seed):
    p = random_acceptance(seed * 10 + K, K)
    for max_depth in range(1, 5):
        trees = enumerate_trees(8, max_depth, K)
        for budget in range(1, 8):
            candidates = [(value(t, p), size(t)) for t in trees if size(t) <= budget + 1]
            best = max(v for v, _ in candidates)
            shape = optimal_tree(p, budget, max_depth)
            check_shape(shape, K, budget, max_depth)
            assert shape.expected_tokens == pytest.approx(best, rel=1e-9), (p, budget, max_depth)
            assert expected_tokens(shape.parents, p) == pytest.approx(shape.expected_tokens, rel=1e-12)
            assert value(nested(shape.parents), p) == pytest.approx(best, rel=1e-9)
            # The smallest optimal tree: no smaller one reaches the best value...
            assert all(v < best - 1e-9 for v, n in candidates if n < shape.size)
            # ...so with every p_k > 0 the budget is used up unless the K-ary tree of that depth is full.
            if min(p) > 0:
                full = sum(K ** d for d in range(max_depth + 1))
                assert shape.size == min(budget + 1, full)


@pytest.mark.parametrize("p1", [0.0, 0.3, 0.8, 1.0])
def test_single_child_gives_a_chain(p1):
    for budget, max_depth in [(1, 1), (5, 10), (10, 5), (0, 3), (7, 0)]:
        shape = optimal_tree([p1], budget, max_depth)
        n = min(budget, max_depth) if p1 > 0 else 0  # a chain adds nothing when p1 = 0
        assert shape.parents == tuple(range(-1, n))
        assert shape.expected_tokens == pytest.approx(sum(p1 ** i for i in range(n + 1)))


def test_dp_is_fast_at_sequoia_sizes():
    p = [0.42, 0.15, 0.08, 0.05, 0.03, 0.02, 0.015, 0.01]
    start = time.perf_counter()
    shape = optimal_tree(p, 128, 12)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.5, elapsed
    check_shape(shape, 8, 128, 12)
    assert shape.size == 129
    assert shape.expected_tokens == pytest.approx(expected_tokens(shape.parents, p))
    # bigger budgets or depths never do worse
    assert optimal_tree(p, 64, 12).expected_tokens < shape.expected_tokens
    assert optimal_tree(p, 128, 4).expected_tokens <= shape.expected_tokens


def test_ties_break_deterministically():
    p = [0.4, 0.4]  # equal ranks: many optimal trees
    shapes = {optimal_tree(p, 6, 3) for _ in range(3)}
    assert len(shapes) == 1
    _tables.cache_clear()  # recomputed from scratch: the same tree
    assert optimal_tree(p, 6, 3) in shapes


@pytest.mark.parametrize("bad, message", [
    (dict(acceptance=[], budget=3, max_depth=2), "empty"),
    (dict(acceptance=[0.7, 0.5], budget=3, max_depth=2), "sum"),
    (dict(acceptance=[-0.1], budget=3, max_depth=2), r"\[0, 1\]"),
    (dict(acceptance=[0.5], budget=-1, max_depth=2), "budget"),
    (dict(acceptance=[0.5], budget=3, max_depth=1.5), "max_depth"),
])
def test_bad_arguments_fail_clearly(bad, message):
    with pytest.raises(ValueError, match=message):
        optimal_tree(bad["acceptance"], bad["budget"], bad["max_depth"])


def test_expected_tokens_checks_the_tree():
    assert expected_tokens([-1, 0, 0, 1], [0.5, 0.25]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    with pytest.raises(ValueError, match="more than K = 1"):
        expected_tokens([-1, 0, 0], [0.5])
    with pytest.raises(ValueError, match="precede"):
        expected_tokens([-1, 2, 0], [0.5, 0.2])


def test_acceptance_file_round_trip(tmp_path):
    path = tmp_path / "a" / "acc.json"
    save_acceptance(path, [0.5, 0.2, 0.1], {"model": "m", "positions": 10})
    assert load_acceptance(path) == [0.5, 0.2, 0.1]
    body = json.loads(path.read_text())
    assert body["info"] == {"model": "m", "positions": 10} and body["cumulative"] == pytest.approx([0.5, 0.7, 0.8])
    path.write_text(json.dumps({"acceptance": [0.5]}))
    with pytest.raises(ValueError, match="not an acceptance vector"):
        load_acceptance(path)
    with pytest.raises(FileNotFoundError, match="measure_acceptance"):
        load_acceptance(tmp_path / "missing.json")


# ---- the hardware-aware choice --------------------------------------------------------
def step_time(tree: tuple, target, draft) -> float:
    """Independent of the module: target forward of the whole tree + one draft forward per level with children."""
    levels, level = [], [tree]
    while level:
        levels.append(len(level))
        level = [c for node in level for c in node]
    return target(size(tree)) + sum(draft(w) for w in levels[:tree_depth(tree)])


@pytest.mark.parametrize("seed", range(4))
def test_choice_is_the_global_optimum_when_draft_cost_is_per_level(seed):
    """Target latency rising with tokens, draft latency the same for any level width: the
    best of the DP trees over the budget x depth grid is the best of ALL trees."""
    rng = random.Random(seed)
    K = 3
    p = random_acceptance(100 + seed, K)
    base, slope, per_level = 1.0, rng.uniform(0.02, 0.5), rng.uniform(0.0, 0.3)
    target = lambda n: base + slope * (n - 1)  # noqa: E731
    draft = lambda w: per_level  # noqa: E731
    shape, info = choose_tree(p, target, draft, budgets=range(0, 7), depths=range(0, 4))
    brute = min(step_time(t, target, draft) / value(t, p) for t in enumerate_trees(7, 3, K))
    assert info["predicted_time_per_token"] == pytest.approx(brute, rel=1e-9)
    assert predicted_time_per_token(shape, target, draft) == pytest.approx(brute, rel=1e-9)
    assert info["predicted_speedup"] == pytest.approx(base / brute)
    assert len(info["table"]) == 7 * 4


@pytest.mark.parametrize("seed", range(4))
def test_choice_is_the_grid_minimum_with_width_dependent_latencies(seed):
    rng = random.Random(seed)
    p = random_acceptance(200 + seed, 4)
    # dicts token-count -> seconds, as a measured profile gives them
    target = {n: 0.045 + 0.0004 * n ** rng.uniform(1.0, 1.5) for n in range(1, 40)}
    draft = {w: 0.006 + 0.0003 * w for w in range(1, 40)}
    budgets, depths = [1, 2, 4, 8, 16, 32], [1, 2, 3, 5, 8]
    shape, info = choose_tree(p, target, draft, budgets, depths, autoregressive_s=0.04)
    grid = {(b, d): step_time(nested(optimal_tree(p, b, d).parents), target.__getitem__, draft.__getitem__)
            / optimal_tree(p, b, d).expected_tokens for b, d in itertools.product(budgets, depths)}
    best = min(grid, key=grid.get)
    assert (info["budget"], info["depth"]) == best
    assert shape == optimal_tree(p, *best)
    assert info["predicted_time_per_token"] == pytest.approx(grid[best])
    assert info["predicted_speedup"] == pytest.approx(0.04 / grid[best])
    assert info["expected_tokens"] == shape.expected_tokens and info["size"] == shape.size


def test_choice_follows_the_hardware():
    p = [0.6, 0.2, 0.1]
    # forward cost flat in tokens (memory-bound accelerator), free draft: the biggest tree wins
    shape, info = choose_tree(p, lambda n: 1.0, lambda w: 0.0, [1, 4, 16, 64], [2, 4, 8])
    assert (info["budget"], info["depth"]) == (64, 8) and info["predicted_speedup"] > 3
    # cost proportional to tokens (compute-bound CPU): no tree beats one token per forward
    shape, info = choose_tree(p, lambda n: 1.0 * n, lambda w: 0.0, [0, 1, 4, 16], [1, 4])
    assert shape.size == 1 and info["predicted_speedup"] == pytest.approx(1.0)
    # an expensive draft forward per level: shallow trees
    _, deep = choose_tree(p, lambda n: 1.0, lambda w: 0.01, [32], [1, 2, 4, 8, 16])
    _, shallow = choose_tree(p, lambda n: 1.0, lambda w: 0.5, [32], [1, 2, 4, 8, 16])
    assert shallow["tree_depth"] < deep["tree_depth"]
    with pytest.raises(ValueError, match="no latency for a forward of 4 tokens"):
        choose_tree(p, {1: 1.0, 2: 1.0}, {1: 0.1}, [4], [1])
    with pytest.raises(ValueError, match="at least one budget"):
        choose_tree(p, lambda n: 1.0, lambda w: 0.0, [], [2])


def test_latency_from_the_device_profile(tmp_path):
    profile = {"latency_s": [0.02, 0.03, 0.04, 0.05], "autoregressive_s": 0.01}
    latency = profile_latency(profile)
    assert [latency(n) for n in (1, 2, 4)] == pytest.approx([0.02, 0.03, 0.05])
    assert latency(10) == pytest.approx(0.11)  # the upper half's slope, 0.01 per token
    target = tiny_lm(seed=3, layers=4)
    draft = LM(self_draft_model(target.model, 1), name="tiny/self-1")
    target_s, draft_s, unit = device_latency(target, draft, tmp_path, max_tokens=4)
    assert len(list((tmp_path / "latency").glob("*.json"))) == 2  # one profile per LM
    assert unit > 0 and target_s(1) > 0 and draft_s(3) > 0 and target_s(6) >= target_s(4)


# ---- measuring the acceptance vector --------------------------------------------------
PROMPTS = [[3, 9, 4, 1, 7], [12, 5, 5, 30, 2, 8], [40]]


def pair(seed: int, draft_layers: int = 1):
    target = tiny_lm(seed=seed, layers=4)
    return target, LM(self_draft_model(target.model, draft_layers), name=f"tiny/self-{draft_layers}")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("sampling",
                         [Sampling(), Sampling(temperature=1.0, seed=5), Sampling(temperature=0.7, top_p=0.8)])
def test_measured_vector_is_a_distribution(seed, sampling):
    target, draft = pair(seed, draft_layers=1 + seed % 3)
    p = measure_acceptance(target, draft, PROMPTS, 4, sampling, 12)
    assert len(p) == 4 and all(0 <= x <= 1 for x in p) and sum(p) <= 1 + 1e-12
    counts, positions = acceptance_counts(target, draft, PROMPTS, 4, sampling, 12)
    assert positions == 3 * 12 and [c / positions for c in counts] == p  # same seed, same draws


@pytest.mark.parametrize("sampling",
                         [Sampling(), Sampling(temperature=1.0, seed=1), Sampling(temperature=0.6, top_p=0.9)])
def test_the_target_as_its_own_draft_is_always_accepted_first(sampling):
    target = tiny_lm(seed=4, layers=2)
    assert measure_acceptance(target, target, PROMPTS, 3, sampling, 10) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("seed", range(2))
def test_greedy_ranks_match_a_full_sequence_recount(seed):
    """The measurement's greedy path is autoregressive greedy, and each position's rank is the
    target token's place in the draft's top K, recomputed here from one causal pass over the
    whole sequence."""
    K = 6
    target, draft = pair(seed, draft_layers=2)
    expected = [0] * K
    for prompt in PROMPTS:
        out = autoregressive_decode(target, prompt, 10, Sampling(), set()).tokens
        seq = prompt + out[:-1]
        t = target.forward(seq, target.new_cache())[len(prompt) - 1:]
        d = draft.forward(seq, draft.new_cache())[len(prompt) - 1:]
        assert torch.argmax(t, dim=-1).tolist() == out
        for row, token in zip(d, out):
            top = torch.topk(row, K).indices.tolist()
            if token in top:
                expected[top.index(token)] += 1
    counts, positions = acceptance_counts(target, draft, PROMPTS, K, Sampling(), 10)
    assert positions == 30 and counts == expected
    assert sum(expected) > 0  # the pair agrees sometimes: the comparison is not vacuous


def test_sampled_rank_accepts_the_first_child_with_one_minus_tv_and_commits_target_tokens():
    """One tree level, K children drawn without replacement and verified by Sequoia's rejection:
    P(rank 1) = sum_x min(p, q), and the committed token follows the target distribution."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.05, 0.0, 0.0])
    q = torch.tensor([0.1, 0.1, 0.3, 0.2, 0.1, 0.0, 0.1, 0.1])
    n = 6000
    ranks, tokens = [0] * 4, [0] * 8
    for _ in range(n):
        rank, token = _sampled_rank(p, q, 3, gen)
        ranks[rank] += 1
        tokens[token] += 1
    first = float(torch.minimum(p, q).sum())
    assert abs(ranks[1] / n - first) < 4 * (first * (1 - first) / n) ** 0.5
    assert ranks[1] > ranks[2] > 0 and ranks[3] > 0
    assert chi2_pvalue(tokens, p) > 1e-3


def test_cached_acceptance_measures_once_per_key(tmp_path, monkeypatch):
    target, draft = pair(5)
    first = cached_acceptance(target, draft, PROMPTS, 3, Sampling(), 8, cache_dir=tmp_path, info={"dataset": "toy"})
    files = list((tmp_path / "acceptance").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["info"]["dataset"] == "toy"
    monkeypatch.setattr("decoders.tuning.sequoia_acceptance.acceptance_counts",
                        lambda *a, **k: pytest.fail("measured again"))
    assert cached_acceptance(target, draft, PROMPTS, 3, Sampling(), 8, cache_dir=tmp_path) == first
    # every part of the key separates entries
    for args in [(PROMPTS[:2], 3, Sampling(), 8), (PROMPTS, 4, Sampling(), 8),
                 (PROMPTS, 3, Sampling(temperature=0.5), 8), (PROMPTS, 3, Sampling(), 9)]:
        with pytest.raises(pytest.fail.Exception, match="measured again"):
            cached_acceptance(target, draft, *args, cache_dir=tmp_path)


def test_fingerprint_tells_drafts_apart():
    target = tiny_lm(seed=6, layers=4)
    plain = LM(self_draft_model(target.model, 2), name="t/self-2")
    adapter = new_exit_adapter(target.model)
    with torch.no_grad():
        adapter.proj.weight.normal_(std=0.01)
    adapted = LM(self_draft_model(target.model, 2, adapter), name="t/self-2+adapter")
    other = new_exit_adapter(target.model)
    with torch.no_grad():
        other.proj.weight.normal_(std=0.01)
    adapted2 = LM(self_draft_model(target.model, 2, other), name="t/self-2+adapter")
    prints = {model_fingerprint(d, shared_with=target) for d in (plain, adapted, adapted2)}
    assert len(prints) == 3
    assert model_fingerprint(tiny_lm(seed=6, layers=4)) == model_fingerprint(target)


@pytest.mark.slow
def test_measure_script_on_tiny_random(tmp_path):
    out_file = tmp_path / "acc.json"
    out = run_script("measure_acceptance.py", "--prompts", "2", "--max-new-tokens", "6", "--K", "3", "--out",
                     str(out_file), "model=tiny-random", "device=cpu", "draft.layers=1", "draft.adapter=null",
                     "threads=1", "gen.temperature=0.8", f"cache_dir={tmp_path}", *SESSION_TOKENIZER)
    assert out.returncode == 0, out.stderr[-2000:]
    p = load_acceptance(out_file)
    info = json.loads(out_file.read_text())["info"]
    assert len(p) == 3 and info["positions"] == 12 and info["prompts"] == 2
    assert (info["model"], info["draft"], info["dataset"], info["temperature"]) == (
        "tiny-random", "tiny-random/self-1", "humaneval", 0.8)
    assert f"{p[0]:.4f}" in out.stdout and "expected tokens per step" in out.stdout
