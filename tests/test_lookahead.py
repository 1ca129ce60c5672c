"""Lookahead decoding (decoders/methods/lookahead.py) and Jacobi decoding (decoders/methods/jacobi.py) beyond greedy
equality (tests/test_greedy_equality.py covers that):

- the fused pass's attention layout (window_mask, decoders.core.loop.layout) against a brute-force definition,
  and against plain causal forwards of each fed token's history on a real (tiny) model;
- KV-cache hygiene: after every step the cache holds exactly the committed tokens' entries;
- the per-step trace (forward tokens, context, drafts, pool info) against what the algorithm implies;
- sampling is lossless: the joint distribution of the first three tokens sampled by lookahead and
  Jacobi (temperature, top-k, top-p) matches the EXACT distribution enumerated from the target's
  probabilities (chi-square goodness of fit, p-value threshold 1e-3, fixed seeds), on a model and
  prompt where the drafts are actually accepted often; negative controls show the same test
  rejects a wrong distribution and a wrong verifier.
"""
from __future__ import annotations

import random

import pytest
import torch

import decoders.core.loop as loop_module  # the loop verifies; negative controls patch it there
import decoders.methods.lookahead as lookahead_module
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.jacobi import Jacobi
from decoders.core.loop import SideBranch, layout
from decoders.methods.prompt_lookup import PromptLookupDecoding
from decoders.methods.recycling import Recycling
from decoders.methods.suffix import Suffix
from decoders.methods.lookahead import Lookahead, window_mask, window_offsets
from decoders.methods.ngram_pool import NGramPool
from decoders.core.sampling import Sampling, probs
from decoders.core.trace import check_generation
from decoders.core.tree import TokenTree
from helpers import chi2_pvalue, tiny_lm

ALPHA = 1e-3
GREEDY = Sampling()


def step_inputs(c, u, levels, width, tree, branch_mask):
    """The loop's layout of one lookahead step: u committed tokens, the window, the trie."""
    side = SideBranch(tokens=[0] * (levels * width), mask=branch_mask, offsets=window_offsets(levels, width), rows=[])
    return layout(c, u, tree, side)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models' ops are too small to gain from intra-op threads; one thread is faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cycle_prompt(lm, length: int = 16) -> list[int]:
    """The tail of the model's own greedy output from [0]. On a small vocabulary it settles into a
    cycle, which the model keeps following: the prompt's n-grams are then good guesses."""
    return autoregressive_decode(lm, [0], 40, GREEDY, stop_ids=set()).tokens[-length:]


# ==== 1. the fused pass's attention layout ============================================================
def random_tree(rng: random.Random, root: int, ngram: int, count: int) -> TokenTree:
    """A trie of `count` random (ngram-1)-grams over 3 tokens (so prefixes are often shared)."""
    grams = [[rng.randrange(3) for _ in range(ngram - 1)] for _ in range(count)]
    return TokenTree.from_sequences(root, grams)


def reference_layout(c: int, u: int, levels: int, width: int, tree: TokenTree):
    """The definition, written independently of the code under test. Fed tokens, in order:
    the u uncached committed tokens, the window's guesses (level-major), the trie's nodes after the
    root. Keys: the c cached positions, then the fed tokens.
    - committed token i: position c + i; sees the cache and committed tokens 0..i;
    - guess (l, j): position root + 1 + l + j; sees the cache, every committed token, level 0's
      guesses 0..j and the guesses (1..l, j);
    - trie node k: position root + depth(k); sees the cache, every committed token and the nodes on
      its path (itself included; the root is the last committed token).
    Returns the items, the (q, c + q) mask and the positions."""
    root = c + u - 1
    items = ([("commit", i) for i in range(u)] + [("guess", level, j) for level in range(levels) for j in range(width)]
             + [("node", k) for k in range(1, len(tree))])

    def position(item):
        if item[0] == "commit":
            return c + item[1]
        if item[0] == "guess":
            return root + 1 + item[1] + item[2]
        return root + tree.depths[item[1]]

    def sees(query, key):
        if key[0] == "commit":
            return query[0] != "commit" or key[1] <= query[1]
        if query[0] == "guess" and key[0] == "guess":
            (level, j), (kl, kj) = query[1:], key[1:]
            return (kl == 0 and kj <= j) or (1 <= kl <= level and kj == j)
        if query[0] == "node" and key[0] == "node":
            return key[1] in tree.path(query[1])
        return False  # committed tokens see no guess; window and trie never see each other

    mask = torch.tensor([[True] * c + [sees(q, k) for k in items] for q in items], dtype=torch.bool)
    positions = torch.tensor([position(q) for q in items], dtype=torch.long)
    return items, mask, positions


def random_layout(seed: int):
    rng = random.Random(seed)
    c = rng.choice([0, 0, 1, 3, 7])
    u = rng.randint(1, 4) if c else rng.randint(1, 6)
    levels, width = rng.randint(1, 4), rng.randint(1, 5)
    ngram = rng.randint(2, 5)
    tree = random_tree(rng, root=rng.randrange(3), ngram=ngram, count=rng.choice([0, 1, 2, 4, 6]))
    return c, u, levels, width, tree


@pytest.mark.parametrize("levels", [1, 2, 3, 5])
@pytest.mark.parametrize("width", [1, 2, 4, 6])
def test_window_mask_matches_definition(levels, width):
    _, mask, _ = reference_layout(0, 1, levels, width, TokenTree([0], [-1]))
    lw = levels * width
    got = window_mask(levels, width)
    assert got.dtype == torch.bool and got.shape == (lw, lw)
    assert torch.equal(got, mask[1:, 1:])


@pytest.mark.parametrize("seed", range(40))
def test_step_inputs_matches_definition(seed):
    c, u, levels, width, tree = random_layout(seed)
    items, ref_mask, ref_positions = reference_layout(c, u, levels, width, tree)
    mask, positions = step_inputs(c, u, levels, width, tree, window_mask(levels, width))
    q = u + levels * width + len(tree) - 1
    assert mask.dtype == torch.bool and mask.shape == (q, c + q) == ref_mask.shape
    assert positions.tolist() == ref_positions.tolist()
    bad = [(items[r], c_ - c) for r, c_ in (mask != ref_mask).nonzero().tolist()]
    assert not bad, f"mask differs from the definition at (query, fed key index): {bad[:10]}"


@pytest.mark.parametrize("seed", range(40))
def test_every_fed_token_sees_a_proper_causal_history(seed):
    """For every fed token, the positions of what it sees (cache, committed, guesses, itself) are
    exactly 0..its own position, each once: as in a plain causal pass over its own history."""
    c, u, levels, width, tree = random_layout(seed)
    mask, positions = step_inputs(c, u, levels, width, tree, window_mask(levels, width))
    key_positions = torch.cat([torch.arange(c), positions])
    for row in range(mask.shape[0]):
        seen = sorted(key_positions[mask[row]].tolist())
        assert mask[row, c + row], f"row {row} does not see itself"
        assert seen == list(range(int(positions[row]) + 1)), (row, seen, int(positions[row]))


@pytest.mark.parametrize("seed", range(20))
def test_branches_are_isolated(seed):
    c, u, levels, width, tree = random_layout(seed)
    mask, positions = step_inputs(c, u, levels, width, tree, window_mask(levels, width))
    lw, t = levels * width, len(tree) - 1
    # fed tokens' rows, and the same tokens' key columns (after the c cached ones)
    committed, window, trie = slice(0, u), slice(u, u + lw), slice(u + lw, u + lw + t)
    key = lambda rows: slice(c + rows.start, c + rows.stop)  # noqa: E731
    assert mask[:, :c].all()  # everything sees the whole cache
    assert not mask[committed, c + u:].any()  # committed tokens see no guess
    assert torch.equal(mask[committed, key(committed)], torch.ones(u, u, dtype=torch.bool).tril())
    assert mask[u:, key(committed)].all()  # both branches follow every committed token
    assert not mask[window, key(trie)].any() and not mask[trie, key(window)].any()
    root = c + u - 1
    assert positions[committed].tolist() == list(range(c, c + u))
    assert positions[trie].tolist() == [root + d for d in tree.depths[1:]]


def plain_history_logits(lm, history):
    return lm.forward(history, lm.new_cache(), last_only=True)[-1]


@pytest.mark.parametrize("seed", range(4))
def test_fused_pass_rows_equal_plain_causal_forwards(seed):
    """On a real model (through LM.forward and a non-empty cache), every row of the fused pass
    equals the logits of a plain causal forward over that fed token's own history."""
    rng = random.Random(100 + seed)
    lm = tiny_lm(seed=seed, vocab=16, attn="eager" if seed % 2 else "sdpa")
    c, u = [(0, 5), (4, 1), (6, 3), (2, 2)][seed]
    levels, width, ngram = [(1, 3, 2), (3, 2, 4), (2, 4, 3), (4, 1, 5)][seed]
    prefix = [rng.randrange(16) for _ in range(c)]
    feed = [rng.randrange(16) for _ in range(u)]
    guesses = [[rng.randrange(16) for _ in range(width)] for _ in range(levels)]
    grams = [[rng.choice([1, 2, 3]) for _ in range(ngram - 1)] for _ in range(5)]
    tree = TokenTree.from_sequences(feed[-1], grams)
    cache = lm.new_cache()
    if c:
        lm.forward(prefix, cache)
    mask, positions = step_inputs(c, u, levels, width, tree, window_mask(levels, width))
    branch = [t for level in guesses for t in level]
    logits = lm.forward(feed + branch + tree.tokens[1:], cache, position_ids=positions, mask=mask)
    histories = [prefix + feed[:i + 1] for i in range(u)]
    histories += [prefix + feed + guesses[0][:j + 1] + [guesses[k][j] for k in range(1, level + 1)]
                  for level in range(levels) for j in range(width)]
    histories += [prefix + feed + [tree.tokens[i] for i in tree.path(k)[1:]] for k in range(1, len(tree))]
    assert len(histories) == logits.shape[0]
    for row, history in enumerate(histories):
        assert int(positions[row]) == len(history) - 1
        torch.testing.assert_close(logits[row], plain_history_logits(lm, history), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, row=row: f"row {row}: {m}")


# ==== 2. KV-cache hygiene ================================================================================
class CacheSpy:
    """Wraps lm.new_cache so that the decoder's own KVCache is captured, and every keep()/crop() it
    makes is followed by a snapshot of the whole cache (each layer's keys and values).

    The decoder edits its cache once per step, after the step's tokens are committed and before
    the next pass, and returns right after the last pass without editing it. So snapshot i is the
    cache the pass of step i + 1 starts from, and must equal the cache of one plain causal forward
    over prompt + the tokens committed by steps 0..i, minus the last one (the bonus token, which
    the next step feeds). The cache returned at the end must still hold that state in its first
    `context_tokens` entries (of the last step), followed by the last pass's entries."""

    def __init__(self, monkeypatch, lm):
        self.lm = lm
        self.real_new_cache = lm.new_cache
        self.caches, self.snapshots, self.edits = [], [], []
        monkeypatch.setattr(lm, "new_cache", self._new_cache)

    def _new_cache(self, **kwargs):
        cache = self.real_new_cache(**kwargs)
        self.caches.append(cache)
        for name in ("keep", "crop"):
            real = getattr(cache, name)

            def wrapped(arg, _real=real, _name=name, _cache=cache):
                _real(arg)
                self.edits.append((_name, list(arg) if _name == "keep" else arg))
                self.snapshots.append(self.state(_cache))
            setattr(cache, name, wrapped)
        return cache

    @staticmethod
    def state(cache):
        return [(layer.keys.clone(), layer.values.clone()) for layer in cache.hf.layers]

    def reference(self, ids):
        cache = self.real_new_cache()
        self.lm.forward(ids, cache)
        return self.state(cache)

    def check(self, prompt, gen):
        assert len(self.caches) == 1, "the decoder should build exactly one cache"
        steps = gen.steps
        assert len(self.snapshots) == len(steps) - 1, "one cache edit per step but the last"
        ref = self.reference(prompt + gen.tokens[:-1])
        assert len(ref) == self.lm.config.num_hidden_layers
        assert all(len(snap) == len(ref) for snap in self.snapshots)
        committed = 0
        for i, snap in enumerate(self.snapshots):
            committed += steps[i].committed
            length = len(prompt) + committed - 1
            assert steps[i + 1].context_tokens == length
            for layer, ((k, v), (rk, rv)) in enumerate(zip(snap, ref)):
                assert k.shape[-2] == v.shape[-2] == length, (i, layer, k.shape, length)
                torch.testing.assert_close(k, rk[..., :length, :], atol=1e-5, rtol=1e-4,
                                           msg=lambda m, i=i, layer=layer: f"keys after step {i}, layer {layer}: {m}")
                torch.testing.assert_close(v, rv[..., :length, :], atol=1e-5, rtol=1e-4,
                                           msg=lambda m, i=i, layer=layer: f"values after step {i}, layer {layer}: {m}")
        # The cache as returned: the last pass's context, then exactly that pass's fed tokens.
        last = steps[-1]
        final = self.state(self.caches[0])
        for (k, v), (rk, rv) in zip(final, ref):
            assert k.shape[-2] == last.context_tokens + last.forward_tokens
            if last.context_tokens:
                torch.testing.assert_close(k[..., :last.context_tokens, :], rk[..., :last.context_tokens, :],
                                           atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(v[..., :last.context_tokens, :], rv[..., :last.context_tokens, :],
                                           atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window,ngram,guess_set_size,attn", [
    (5, 4, 5, "sdpa"), (1, 2, 1, "sdpa"), (3, 3, -1, "sdpa"), (2, 5, 3, "eager"), (3, 2, 0, "sdpa")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lookahead_cache_holds_exactly_the_committed_tokens(monkeypatch, window, ngram, guess_set_size, attn,
                                                            temperature):
    lm = tiny_lm(seed=1, vocab=8, init_std=0.4, attn=attn)
    prompt = cycle_prompt(lm)
    spy = CacheSpy(monkeypatch, lm)
    gen = Lookahead(window=window, ngram=ngram, guess_set_size=guess_set_size).generate(
        lm, prompt, 24, Sampling(temperature=temperature, seed=3), set())
    check_generation(gen, 24, set())
    spy.check(prompt, gen)
    hits = sum(s.accepted_draft_tokens > 0 for s in gen.steps)
    if guess_set_size != 0:
        # accepted trie nodes sit after the window in the pass: their keep() must move entries
        assert hits > 0, "no draft was accepted: the keep() of an accepted path went untested"
        moved = [idx for name, idx in spy.edits if idx != list(range(len(idx)))]
        assert len(moved) >= hits - (gen.steps[-1].accepted_draft_tokens > 0)


@pytest.mark.parametrize("block_size", [1, 3, 6])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_jacobi_cache_holds_exactly_the_committed_tokens(monkeypatch, block_size, temperature):
    lm = tiny_lm(seed=1, vocab=8, init_std=0.4)
    prompt = cycle_prompt(lm)
    spy = CacheSpy(monkeypatch, lm)
    gen = Jacobi(block_size=block_size).generate(lm, prompt, 24, Sampling(temperature=temperature, seed=3), set())
    check_generation(gen, 24, set())
    spy.check(prompt, gen)
    assert any(s.accepted_draft_tokens > 0 for s in gen.steps[:-1]), "no draft accepted: a weak test"


def test_one_step_generation_never_edits_the_cache(monkeypatch):
    lm = tiny_lm(seed=2, vocab=16)
    spy = CacheSpy(monkeypatch, lm)
    gen = Lookahead(window=3, ngram=3, guess_set_size=3).generate(lm, [3, 4, 5], 1, GREEDY, set())
    assert len(gen.steps) == 1 and gen.tokens and not spy.edits


# ==== 3. the trace ===================================================================================
class RecordingPool(NGramPool):
    """The decoder's pool, recording every lookup and add (and whether the add came from
    add_from, i.e. from committed tokens, or from the window), checking the per-key cap on every add."""

    last: "RecordingPool | None" = None

    def __init__(self, n, per_key):
        super().__init__(n, per_key)
        self.events: list[tuple] = []  # ("lookup", key, grams) | ("add", key, gram, from_tokens)
        self._in_add_from = False
        RecordingPool.last = self

    @property
    def lookups(self):
        return [e[1:] for e in self.events if e[0] == "lookup"]

    def candidates(self, key):
        got = super().candidates(key)
        self.events.append(("lookup", key, got))
        return got

    def add_from(self, tokens, start=0):
        self._in_add_from = True
        try:
            super().add_from(tokens, start)
        finally:
            self._in_add_from = False

    def add(self, key, gram):
        super().add(key, gram)
        self.events.append(("add", key, tuple(gram), self._in_add_from))
        assert len(gram) == self.n - 1
        if self.per_key >= 0:
            assert len(super().candidates(key)) <= self.per_key, "the per-key cap was exceeded"


def trie_nodes(grams) -> int:
    """Distinct non-empty prefixes: the nodes of the trie the grams merge into (root excluded)."""
    return len({tuple(g[:k]) for g in grams for k in range(1, len(g) + 1)})


def prompt_candidates(prompt, ngram, guess_set_size):
    """What the pool seeded with the prompt offers after prompt[-1]: the distinct grams that follow
    it, most recent LAST occurrence first, at most G of them (brute force)."""
    last = {}
    for i in range(len(prompt) - ngram + 1):
        if prompt[i] == prompt[-1]:
            last[tuple(prompt[i + 1:i + ngram])] = i
    ordered = sorted(last, key=last.get, reverse=True)
    return ordered if guess_set_size < 0 else ordered[:guess_set_size]


TRACE_CASES = {
    # name: (window, ngram, guess_set_size, pool_from_prompt, prompt kind, temperature)
    "5-4-5-cycle": (5, 4, 5, True, "cycle", 0.0),
    "5-4-5-cycle-sampled": (5, 4, 5, True, "cycle", 0.8),
    "3-2-3-random": (3, 2, 3, True, "random", 0.0),
    "1-5-2-cycle": (1, 5, 2, True, "cycle", 0.0),
    "4-3-unbounded-cycle": (4, 3, -1, True, "cycle", 0.0),
    "2-3-1-cycle-sampled": (2, 3, 1, True, "cycle", 1.0),
    "3-3-3-noprompt": (3, 3, 3, False, "cycle", 0.0),
    "7-6-4-random-sampled": (7, 6, 4, True, "random", 0.8),
}


@pytest.mark.parametrize("case", TRACE_CASES)
@pytest.mark.parametrize("max_new_tokens,eos_at", [(23, None), (40, 9)])
def test_lookahead_trace(monkeypatch, case, max_new_tokens, eos_at):
    W, N, G, from_prompt, kind, temperature = TRACE_CASES[case]
    monkeypatch.setattr(lookahead_module, "NGramPool", RecordingPool)
    lm = tiny_lm(seed=1, vocab=8, init_std=0.4)
    rng = random.Random(W * N)
    # (15: this model's cycle then starts and ends on different tokens, so a lookup after the
    # prompt's first token instead of its last would show)
    prompt = cycle_prompt(lm, 15) if kind == "cycle" else [rng.randrange(8) for _ in range(11)]
    sampling = Sampling(temperature=temperature, seed=W + N)
    decoder = Lookahead(window=W, ngram=N, guess_set_size=G, pool_from_prompt=from_prompt)
    stop = set()
    if eos_at is not None:  # a stop token the output reaches mid-way, possibly inside an accepted draft
        free = decoder.generate(lm, prompt, max_new_tokens, sampling, set()).tokens
        stop = {free[eos_at]}
    gen = decoder.generate(lm, prompt, max_new_tokens, sampling, stop)
    check_generation(gen, max_new_tokens, stop)
    pool = RecordingPool.last
    steps = gen.steps
    assert len(pool.lookups) == len(steps)
    check_steps(gen, pool, prompt, lm, W=W, N=N, G=G)
    # step 0's candidates: exactly what the prompt offers (nothing without pool_from_prompt)
    first = pool.lookups[0][1]
    assert first == (prompt_candidates(prompt, N, G) if from_prompt else [])
    if kind == "cycle" and temperature == 0:
        assert any(s.info["hit"] for s in steps), "no hit on a cyclic prompt: the hit checks went untested"
    check_pool_additions(pool, prompt, gen, W=W, N=N, from_prompt=from_prompt)


def check_steps(gen, pool, prompt, lm, *, W, N, G):
    """Each step's trace against the lookup the pool recorded for it: the key, the trie of
    candidates, the tokens fed, what was accepted and committed, the pool's size."""
    sequence = prompt + gen.tokens
    committed, previous_pool = 0, 0
    for s, (step, (key, grams)) in enumerate(zip(gen.steps, pool.lookups)):
        levels = min(s + 1, N - 1)  # level l of the window fills at step l
        assert set(step.info) == {"pool", "candidates", "hit"}
        # the candidates were looked up after the last committed token, and form the trie
        assert key == sequence[len(prompt) + committed - 1]
        assert step.info["candidates"] == len(grams) == len(set(grams))
        assert all(len(g) == N - 1 for g in grams)
        assert step.draft_tokens == trie_nodes(grams)
        if G >= 0:
            assert len(grams) <= G and step.draft_tokens <= G * (N - 1)
        uncached = len(prompt) if s == 0 else 1
        assert step.forward_tokens == uncached + W * levels + step.draft_tokens
        assert step.context_tokens == (0 if s == 0 else len(prompt) + committed - 1)
        if s > 0 and G >= 0:
            assert step.forward_tokens <= 1 + W * (N - 1) + G * (N - 1)
        # accepted drafts: a path down the trie, plus the bonus token unless the output ended
        assert step.info["hit"] == (step.accepted_draft_tokens > 0)
        assert 0 <= step.accepted_draft_tokens <= min(step.draft_tokens, N - 1)
        assert 1 <= step.committed <= N
        if s < len(gen.steps) - 1:
            assert step.committed == step.accepted_draft_tokens + 1
        else:
            assert step.accepted_draft_tokens <= step.committed
        # the pool only grows (an eviction replaces a gram) and respects G per key
        assert step.info["pool"] >= previous_pool
        if G >= 0:
            assert step.info["pool"] <= G * lm.vocab_size
        previous_pool = step.info["pool"]
        committed += step.committed
    assert committed == len(gen.tokens)


def check_pool_additions(pool, prompt, gen, *, W, N, from_prompt):
    """Every n-gram of prompt + output went into the pool exactly once, in order (those of the
    prompt alone only with pool_from_prompt), and the window adds its W columns' n-grams once
    per step from step N-2 on (when its N-1 levels are full)."""
    sequence = prompt + gen.tokens
    from_tokens = [(e[1], *e[2]) for e in pool.events if e[0] == "add" and e[3]]
    first = 0 if from_prompt else max(0, len(prompt) - N + 1)
    assert from_tokens == [tuple(sequence[i:i + N]) for i in range(first, len(sequence) - N + 1)]
    per_step, s = [0] * len(gen.steps), -1
    for e in pool.events:
        if e[0] == "lookup":
            s += 1
        elif not e[3]:
            assert s >= 0, "a window n-gram added before the first pass"
            per_step[s] += 1
    assert per_step == [W if s >= N - 2 else 0 for s in range(len(gen.steps))]


@pytest.mark.parametrize("window,ngram", [(3, 2), (1, 4), (5, 5)])
def test_lookahead_without_guesses_is_one_token_per_step(window, ngram):
    """G = 0: no n-gram is kept nor verified; each pass commits exactly the target's own token."""
    lm = tiny_lm(seed=1, vocab=8, init_std=0.4)
    prompt = cycle_prompt(lm)
    gen = Lookahead(window=window, ngram=ngram, guess_set_size=0).generate(
        lm, prompt, 12, Sampling(temperature=0.8, seed=1), set())
    assert len(gen.steps) == len(gen.tokens) == 12
    for s, step in enumerate(gen.steps):
        assert step.committed == 1 and step.draft_tokens == 0 and step.accepted_draft_tokens == 0
        assert step.info == {"pool": 0, "candidates": 0, "hit": False}
        assert step.forward_tokens == (len(prompt) if s == 0 else 1) + window * min(s + 1, ngram - 1)


@pytest.mark.parametrize("block_size", [1, 3, 8])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_jacobi_trace(block_size, temperature):
    lm = tiny_lm(seed=1, vocab=8, init_std=0.4)
    prompt = cycle_prompt(lm)
    gen = Jacobi(block_size=block_size).generate(lm, prompt, 23, Sampling(temperature=temperature, seed=2), set())
    check_generation(gen, 23, set())
    committed = 0
    for s, step in enumerate(gen.steps):
        assert step.forward_tokens == (len(prompt) if s == 0 else 1) + block_size
        assert step.context_tokens == (0 if s == 0 else len(prompt) + committed - 1)
        assert step.draft_tokens == block_size
        assert 0 <= step.accepted_draft_tokens <= block_size and 1 <= step.committed <= block_size + 1
        if s < len(gen.steps) - 1:
            assert step.committed == step.accepted_draft_tokens + 1
        committed += step.committed
    assert committed == 23
    if block_size > 1:
        assert any(s.accepted_draft_tokens > 0 for s in gen.steps), "no guess accepted: a weak test"


# ==== 4. sampling is lossless ==========================================================================
VOCAB = 8
LENGTH = 3  # tokens per generation: the joint of all three is compared, VOCAB ** 3 cells
N_SAMPLES = 1000
N_CONTROL = 400
MIN_HIT_SHARE = 0.2  # of steps: below this the test would say little about the draft-acceptance path


@pytest.fixture(scope="module")
def stat_model():
    """init_std 0.4: next-token distributions peaked enough (on the cyclic prompt) for n-gram and
    Jacobi guesses to be accepted often, yet spread over several tokens after temperature 0.8."""
    lm = tiny_lm(seed=0, vocab=VOCAB, init_std=0.4)
    return lm, cycle_prompt(lm)


def exact_joint(lm, prompt, sampling: Sampling) -> torch.Tensor:
    """(V, V, V): the exact probability of each 3-token continuation under the target's sampling
    distribution (the same warpers), enumerated: one batched forward over every prompt + (x1, x2)."""
    V = VOCAB
    seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
    with torch.inference_mode():
        logits = lm.model(input_ids=seqs).logits[:, -3:]  # after the prompt, after x1, after x2
    p = probs(logits.reshape(-1, V), sampling).reshape(V, V, 3, V).double()
    p1 = p[0, 0, 0]  # (V,): the same for every (a, b)
    p2 = p[:, 0, 1]  # (V, V): [x1, x2]
    p3 = p[:, :, 2]  # (V, V, V): [x1, x2, x3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(float(joint.sum()) - 1) < 1e-5  # float32 probabilities
    joint = joint / joint.sum()
    # spot check against incremental single-sequence forwards (the decoders' way)
    for seq in [(0, 1, 2), tuple(int(i) for i in torch.nonzero(joint == joint.max())[0])]:
        ref = 1.0
        for t in range(LENGTH):
            row = probs(lm.forward(prompt + list(seq[:t]), lm.new_cache(), last_only=True), sampling)[0]
            ref *= float(row[seq[t]])
        assert joint[seq] == pytest.approx(ref, rel=1e-4, abs=1e-9)
    return joint


def sample_counts(generate, sampling_kwargs: dict, n: int):
    """Counts (V, V, V) of the 3-token outputs over seeds 0..n-1, and the share of steps with an
    accepted draft token."""
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    steps = hits = 0
    for seed in range(n):
        gen = generate(Sampling(**sampling_kwargs, seed=seed))
        check_generation(gen, LENGTH, set())
        assert len(gen.tokens) == LENGTH
        counts[tuple(gen.tokens)] += 1
        steps += len(gen.steps)
        hits += sum(s.accepted_draft_tokens > 0 for s in gen.steps)
    return counts, hits / steps


def assert_matches_exact(lm, prompt, counts, sampling_kwargs, wrong_kwargs):
    joint = exact_joint(lm, prompt, Sampling(**sampling_kwargs))
    assert counts[joint == 0].sum() == 0, "a continuation the target cannot sample was produced"
    p = chi2_pvalue(counts, joint)
    assert p > ALPHA, (sampling_kwargs, p)
    # negative control: the same counts are rejected against a different sampling distribution
    wrong = exact_joint(lm, prompt, Sampling(**wrong_kwargs))
    assert chi2_pvalue(counts, wrong) < ALPHA, (wrong_kwargs, "the test has no power")


SAMPLED_CASES = {
    # name: (decoder, sampling, the wrong sampling of the negative control)
    "lookahead-3-2-3-t0.8": (Lookahead(window=3, ngram=2, guess_set_size=3),
                             dict(temperature=0.8), dict(temperature=1.0)),
    "lookahead-4-4-4-t0.8-topk3": (Lookahead(window=4, ngram=4, guess_set_size=4),
                                   dict(temperature=0.8, top_k=3), dict(temperature=0.8)),
    "lookahead-2-3-unbounded-t0.8-topp0.9": (Lookahead(window=2, ngram=3, guess_set_size=-1),
                                             dict(temperature=0.8, top_p=0.9), dict(temperature=0.8)),
    "jacobi-3-t0.8": (Jacobi(block_size=3), dict(temperature=0.8), dict(temperature=1.0)),
    # prompt lookup: deterministic candidates copied from the text, the same verification
    "prompt_lookup-3-2-t0.8": (PromptLookupDecoding(num_tokens=3, max_ngram=2), dict(temperature=0.8),
                               dict(temperature=1.0)),
    # token recycling: deterministic candidates from the adjacency table, the same verification (hot start:
    # over 3-token outputs a cold table has no time to fill, and the test would prove little)
    "recycling-8-3-3-t0.8": (Recycling(tree_size=8, depth=3, successors=3), dict(temperature=0.8),
                             dict(temperature=1.0)),
    "recycling-6-2-4-t1.0-topk3": (Recycling(tree_size=6, depth=2, successors=4), dict(temperature=1.0, top_k=3),
                                   dict(temperature=1.0)),
    "jacobi-2-t0.8-topp0.9": (Jacobi(block_size=2), dict(temperature=0.8, top_p=0.9), dict(temperature=0.8)),
    # suffix decoding: deterministic candidates from the suffix tries, the same verification; with the global
    # trie each sample drafts from the earlier samples' outputs too (still drawn before this sample's randomness)
    "suffix-t0.8": (Suffix(), dict(temperature=0.8), dict(temperature=1.0)),
    "suffix-request-only-a2-t1.0-topp0.9": (Suffix(alpha=2.0, use_global=False), dict(temperature=1.0, top_p=0.9),
                                            dict(temperature=1.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", SAMPLED_CASES)
def test_sampling_matches_exact_distribution(stat_model, case):
    lm, prompt = stat_model
    decoder, sampling_kwargs, wrong_kwargs = SAMPLED_CASES[case]
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), sampling_kwargs,
                                      N_SAMPLES)
    assert hit_share >= MIN_HIT_SHARE, f"drafts accepted in only {hit_share:.0%} of steps: the test proves little"
    assert_matches_exact(lm, prompt, counts, sampling_kwargs, wrong_kwargs)


def test_recycling_hot_start_carries_the_table_per_target():
    """hot_start: the second prompt drafts from the table the first one filled (so its first
    decoding step already proposes a tree); a new target, or hot_start=false, starts empty."""
    lm, other = tiny_lm(seed=0), tiny_lm(seed=1)
    prompt = [3, 1, 4, 1, 5]
    hot, cold = Recycling(tree_size=6, depth=2, successors=3), Recycling(tree_size=6, depth=2, successors=3,
                                                                         hot_start=False)
    for decoder, second_step_drafts in ((hot, True), (cold, False)):
        decoder.generate(lm, prompt, 20, Sampling(), set())
        again = decoder.generate(lm, prompt, 20, Sampling(), set())
        assert (again.steps[1].draft_tokens > 0) == second_step_drafts
    assert hot.generate(other, [7], 20, Sampling(), set()).steps[1].draft_tokens == 0


def test_recycling_fills_its_template_from_the_table_and_learns_every_row():
    """Token Recycling: a template node holds its parent token's successor of the node's rank in the
    adjacency table (a rank the table lacks drops the node, and its subtree); after verification
    every row of the tree, accepted or not, writes its top-k successors into the table."""
    from decoders.methods.recycling import AdjacencyDraft

    # the template: the root's successors of ranks 0 and 1; under the first its rank 0, under the second its rank 2
    draft = AdjacencyDraft(parents=[-1, 0, 0, 1, 2], ranks=[0, 1, 0, 2], successors=3,
                           table={7: [10, 11], 10: [20, 21, 22], 11: [30]})
    proposal = draft.propose([5, 7], room=10)
    assert proposal.tree.tokens == [7, 10, 11, 20] and proposal.tree.parents == [-1, 0, 0, 1]  # 11 has 1 successor

    class Scores:  # each tree row's top-3 next tokens, as the target's forward gives them
        @staticmethod
        def top():
            return [[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 1, 2]]

    draft.commit(proposal, Scores(), [0, 1], [5, 7, 10])  # only 10 was accepted
    assert draft.table == {7: [1, 2, 3], 10: [4, 5, 6], 11: [7, 8, 9], 20: [0, 1, 2]}


def _verify_without_residual(tree, target_probs, draft_probs, generator, without_replacement=False, draws=None):
    """WRONG: after a deterministic candidate is rejected, the next token is drawn from the target
    p itself instead of p with the candidate zeroed: candidates are over-represented."""
    node, path = 0, [0]
    while True:
        p = target_probs[node]
        for child in tree.children[node]:
            if torch.rand((), generator=generator) < p[tree.tokens[child]]:
                break
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(child)
        node = child


@pytest.mark.slow
def test_negative_control_lookahead_with_a_wrong_verifier_is_rejected(stat_model, monkeypatch):
    """The same test, on lookahead whose verifier forgets the residual, rejects its samples."""
    lm, prompt = stat_model
    monkeypatch.setattr(loop_module, "verify_sampling", _verify_without_residual)
    kwargs = dict(temperature=0.8)
    counts, hit_share = sample_counts(
        lambda s: Lookahead(window=3, ngram=2, guess_set_size=3).generate(lm, prompt, LENGTH, s, set()), kwargs,
        N_CONTROL)
    assert hit_share > 0
    assert chi2_pvalue(counts, exact_joint(lm, prompt, Sampling(**kwargs))) < ALPHA


@pytest.mark.slow
def test_negative_control_suffix_with_a_wrong_verifier_is_rejected(stat_model, monkeypatch):
    """The same check has power on suffix decoding's drafts: with the verifier that forgets the
    residual, its samples are rejected."""
    lm, prompt = stat_model
    monkeypatch.setattr(loop_module, "verify_sampling", _verify_without_residual)
    kwargs = dict(temperature=0.8)
    decoder = Suffix()
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), kwargs, N_CONTROL)
    assert hit_share > 0
    assert chi2_pvalue(counts, exact_joint(lm, prompt, Sampling(**kwargs))) < ALPHA
