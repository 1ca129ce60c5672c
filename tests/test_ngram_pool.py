"""NGramPool (decoders/methods/ngram_pool.py): the (N-1)-grams lookahead decoding verifies, per key token.

Checked against a brute-force reference pool (a plain list per key, least recently used first)
on random operation sequences, plus hand-made cases with a known answer: the per-key cap with
least-recently-used eviction (re-adding a gram refreshes it), -1 = unbounded, 0 = nothing kept,
len() counting grams, candidates() most recent first, and add_from() adding exactly the n-grams
that start at index >= start.
"""
from __future__ import annotations

import random

import pytest

from decoders.methods.ngram_pool import NGramPool


class ReferencePool:
    """The specification, written the slow and obvious way: per key, a list of grams ordered
    from least to most recently added or re-added; adding beyond the cap drops the oldest."""

    def __init__(self, n: int, per_key: int):
        self.n, self.per_key = n, per_key
        self.grams: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key, gram):
        if self.per_key == 0:
            return
        gram = tuple(gram)
        grams = self.grams.setdefault(key, [])
        if gram in grams:
            grams.remove(gram)
        grams.append(gram)
        if self.per_key > 0 and len(grams) > self.per_key:
            del grams[0]

    def candidates(self, key):
        return list(reversed(self.grams.get(key, [])))

    def __len__(self):
        return sum(len(g) for g in self.grams.values())


def brute_force_ngrams(tokens, n, start):
    """(key, gram) for every window tokens[i:i + n] with i >= start, in index order."""
    return [(tokens[i], tuple(tokens[i + 1:i + n])) for i in range(len(tokens)) if i >= start and i + n <= len(tokens)]


def assert_same(pool: NGramPool, ref: ReferencePool, keys):
    assert len(pool) == len(ref)
    for key in keys:
        assert pool.candidates(key) == ref.candidates(key), key


# ---- construction ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 0, -2])
def test_n_below_two_raises(n):
    with pytest.raises(ValueError, match="n >= 2"):
        NGramPool(n, 5)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_valid_n_starts_empty(n):
    pool = NGramPool(n, 3)
    assert len(pool) == 0 and pool.n == n
    assert pool.candidates(0) == [] and pool.candidates(123) == []


# ---- the per-key cap and least-recently-used eviction -------------------------------------------
def test_cap_evicts_least_recently_used():
    pool = NGramPool(3, 2)
    pool.add(7, [1, 2])
    pool.add(7, [3, 4])
    assert pool.candidates(7) == [(3, 4), (1, 2)]
    pool.add(7, [5, 6])  # over the cap: the oldest, (1, 2), goes
    assert pool.candidates(7) == [(5, 6), (3, 4)]
    assert len(pool) == 2


def test_readding_refreshes_instead_of_duplicating():
    pool = NGramPool(3, 2)
    pool.add(7, [1, 2])
    pool.add(7, [3, 4])
    pool.add(7, (1, 2))  # already there (list or tuple alike): now the most recent, not a second copy
    assert pool.candidates(7) == [(1, 2), (3, 4)]
    assert len(pool) == 2
    pool.add(7, [5, 6])  # so (3, 4) is the least recently used one and is evicted
    assert pool.candidates(7) == [(5, 6), (1, 2)]
    assert len(pool) == 2


def test_cap_is_per_key_and_len_counts_grams():
    pool = NGramPool(2, 2)
    for key in range(4):
        for tok in range(5):
            pool.add(key, [10 * key + tok])
    assert len(pool) == 8  # 4 keys x the cap of 2, not the number of keys
    for key in range(4):
        assert pool.candidates(key) == [(10 * key + 4,), (10 * key + 3,)]
    # the same gram under another key is another entry
    pool.add(0, [34])
    assert (34,) in pool.candidates(0) and (34,) in pool.candidates(3)
    assert len(pool) == 8


def test_unbounded():
    pool = NGramPool(3, -1)
    grams = [(a, b) for a in range(12) for b in range(12)]
    random.Random(0).shuffle(grams)
    for g in grams:
        pool.add(5, g)
    assert len(pool) == len(grams) == 144
    assert pool.candidates(5) == grams[::-1]
    pool.add(5, grams[0])  # a refresh, nothing evicted
    assert len(pool) == 144 and pool.candidates(5)[0] == grams[0]
    assert pool.candidates(5)[1:] == grams[1:][::-1]


def test_per_key_zero_stores_nothing():
    pool = NGramPool(3, 0)
    for key in range(5):
        pool.add(key, [key, key + 1])
    pool.add_from([1, 2, 3, 1, 2, 3, 4], start=0)
    assert len(pool) == 0
    assert all(pool.candidates(key) == [] for key in range(10))


def test_candidates_are_a_copy():
    pool = NGramPool(3, 4)
    pool.add(1, [2, 3])
    got = pool.candidates(1)
    got.append((9, 9))
    got.clear()
    assert pool.candidates(1) == [(2, 3)] and len(pool) == 1


@pytest.mark.parametrize("per_key", [-1, 0, 1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_reference(per_key, seed):
    """Random add() sequences over few keys and grams (many refreshes and evictions)."""
    rng = random.Random(1000 * seed + per_key)
    n = rng.choice([2, 3, 4])
    pool, ref = NGramPool(n, per_key), ReferencePool(n, per_key)
    keys = range(4)
    for _ in range(300):
        key = rng.choice(keys)
        gram = [rng.randrange(3) for _ in range(n - 1)]
        pool.add(key, gram)
        ref.add(key, gram)
        assert len(pool) == len(ref)
        assert pool.candidates(key) == ref.candidates(key)
        if per_key > 0:
            assert len(pool.candidates(key)) <= per_key
    assert_same(pool, ref, range(6))
    assert all(len(g) == n - 1 for key in keys for g in pool.candidates(key))
    if per_key != 0:
        assert len(pool) > 0  # the comparison above was not vacuous


# ---- add_from ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("seed", range(3))
def test_add_from_adds_exactly_the_ngrams_from_start(n, seed):
    rng = random.Random(seed * 10 + n)
    tokens = [rng.randrange(4) for _ in range(rng.randint(n + 3, 18))]
    for start in range(-2, len(tokens) + 2):
        pool = NGramPool(n, -1)
        pool.add_from(tokens, start=start)
        expected = brute_force_ngrams(tokens, n, start)
        stored = {(key, gram) for key in set(tokens) for gram in pool.candidates(key)}
        assert stored == set(expected), start
        assert len(pool) == len(set(expected))
        # and in the order they occur: the same as add() called on each in index order
        ref = ReferencePool(n, -1)
        for key, gram in expected:
            ref.add(key, gram)
        assert_same(pool, ref, set(tokens))


def test_add_from_default_start_is_zero_and_short_inputs_add_nothing():
    pool = NGramPool(3, -1)
    pool.add_from([4, 5, 6, 4, 5, 7])
    assert pool.candidates(4) == [(5, 7), (5, 6)] and pool.candidates(5) == [(6, 4)] and pool.candidates(6) == [(4, 5)]
    assert len(pool) == 4
    empty = NGramPool(3, -1)
    empty.add_from([1, 2])  # shorter than n
    empty.add_from([])
    empty.add_from([1, 2, 3], start=1)  # the only 3-gram starts at 0
    assert len(empty) == 0


@pytest.mark.parametrize("per_key", [1, 2, 3])
def test_add_from_with_cap_keeps_the_most_recent_occurrences(per_key):
    """Under a cap, add_from leaves per key the `per_key` grams whose LAST occurrence is latest,
    most recent first (re-occurring grams are refreshed, not duplicated)."""
    rng = random.Random(per_key)
    n = 3
    tokens = [rng.randrange(3) for _ in range(40)]
    pool = NGramPool(n, per_key)
    pool.add_from(tokens)
    for key in set(tokens):
        last = {}
        for i, (k, gram) in enumerate(brute_force_ngrams(tokens, n, 0)):
            if k == key:
                last[gram] = i
        expected = sorted(last, key=last.get, reverse=True)[:per_key]
        assert pool.candidates(key) == expected


def test_add_from_incrementally_equals_all_at_once():
    """How lookahead feeds its output: after each commit, only the n-grams that contain a new
    token (start >= old length - n + 1). The pool ends up as if fed the whole sequence once."""
    rng = random.Random(5)
    n = 4
    prompt = [rng.randrange(5) for _ in range(10)]
    output = [rng.randrange(5) for _ in range(30)]
    incremental, at_once = NGramPool(n, 3), NGramPool(n, 3)
    incremental.add_from(prompt)
    sequence, i = list(prompt), 0
    while i < len(output):
        before = len(sequence)
        step = rng.randint(1, n)
        sequence += output[i:i + step]
        i += step
        incremental.add_from(sequence, start=before - n + 1)
    at_once.add_from(prompt + output)
    assert_same(incremental, at_once, range(5))
