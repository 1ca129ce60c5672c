"""SuffixDecoding (decoders/methods/suffix.py) beyond greedy equality (test_greedy_equality.py runs its
YAML and variants; test_lookahead.py its sampled distribution; test_batch.py its batched rows):

- the suffix trie's counts and matches on hand-made sequences, computed by hand, and against a brute
  force count of every substring on random ones (built whole or token by token);
- the speculation tree: best-first by path probability (count / parent count, multiplied), cut at
  its size (alpha * p, max_spec_tokens), min_token_prob, the trie's depth and the stop tokens; the
  highest-scoring candidate of both tries wins;
- the global trie: a request repeated drafts long from its first output, not without the global
  trie (the negative control), and a new target starts empty;
- its bound (max_cached_requests): past it the oldest outputs are evicted, leaving exactly the trie of
  the outputs kept (against a brute-force count) in reused slots; a request whose earlier output was
  evicted drafts as if it had never been learnt (the negative control: a bound one larger keeps it),
  and every output stays autoregressive's, one prompt at a time or in a batch;
- repeats stay repeats: a timed repeat starts from the global trie its first run started from, so it
  drafts exactly as the first run did (the check fails when the runner does not put the trie back).
"""
from __future__ import annotations

import copy
import random
import re
from collections import Counter

import pytest

from decoders.core.contract import CarriesState, carried_copy, carry, kept_as_is
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.suffix import Suffix, SuffixTrie, best_draft, grow
from helpers import tiny_lm

GREEDY = Sampling()


def node(trie: SuffixTrie, string) -> int | None:
    """The node of `string` (None: not stored)."""
    at = 0
    for token in string:
        at = trie.child(at, token)
        if at is None:
            return None
    return at


def count(trie: SuffixTrie, string) -> int:
    at = node(trie, string)
    return 0 if at is None else trie.count[at]


# ---- the trie ---------------------------------------------------------------------------------------
def test_counts_of_a_hand_made_sequence():
    """a b a b c, cut at depth 3: every substring of at most 3 tokens, counted where it starts."""
    a, b, c = 1, 2, 3
    trie = SuffixTrie(3)
    trie.add([a, b, a, b, c])
    assert trie.count[0] == 5 and trie.sequences == 1
    expected = {(a,): 2, (b,): 2, (c,): 1, (a, b): 2, (b, a): 1, (b, c): 1,
                (a, b, a): 1, (b, a, b): 1, (a, b, c): 1}
    assert {s: count(trie, s) for s in expected} == expected
    assert len(trie) == 1 + len(expected)  # the root and one node per distinct substring: nothing else
    assert node(trie, [a, b, a, b]) is None  # cut at depth 3
    assert trie.kids[node(trie, [a, b, a])] is None


def test_counts_of_two_sequences_add_up():
    trie = SuffixTrie(4)
    trie.add([5, 6, 7])
    trie.add([6, 7, 8, 6, 7])
    assert trie.sequences == 2 and trie.count[0] == 8
    assert count(trie, [6, 7]) == 3 and count(trie, [5, 6, 7]) == 1 and count(trie, [7, 8, 6, 7]) == 1
    assert count(trie, [7, 5]) == 0  # never across two sequences


def brute_counts(sequences, depth: int) -> Counter:
    """Every substring of at most `depth` tokens of each sequence, counted by its start positions."""
    counts = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, min(depth, len(seq) - i) + 1):
                counts[tuple(seq[i:i + n])] += 1
    return counts


def all_counts(trie: SuffixTrie) -> Counter:
    out, stack = Counter(), [(0, ())]
    while stack:
        at, string = stack.pop()
        for token, child in (trie.kids[at] or {}).items():
            out[string + (token,)] = trie.count[child]
            stack.append((child, string + (token,)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_counts_equal_a_brute_force_count(seed):
    """Random sequences over 3 tokens (so substrings repeat): whole (add) or token by token in
    random chunks (extend, as the request's trie grows), the same counts as counting every substring."""
    rng = random.Random(seed)
    depth = rng.randrange(2, 7)
    sequences = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    whole, chunked = SuffixTrie(depth), SuffixTrie(depth)
    for seq in sequences:
        whole.add(seq)
        open_, i = [], 0
        while i < len(seq):
            n = rng.randrange(1, 6)
            open_ = chunked.extend(open_, seq[i:i + n])
            i = min(i + n, len(seq))
            # the open suffixes are the sequence's last 1 .. depth-1 tokens
            assert open_ == [node(chunked, seq[max(0, i - k):i]) for k in range(1, min(i, depth - 1) + 1)]
    expected = brute_counts(sequences, depth)
    assert all_counts(whole) == expected and all_counts(chunked) == expected
    assert len(whole) == 1 + len(expected)


def test_matches_are_the_context_suffixes_found_longest_first_missing():
    trie = SuffixTrie(4)
    trie.add([1, 2, 3, 1, 2, 4])
    assert trie.matches([9, 1, 2]) == [node(trie, [2]), node(trie, [1, 2])]  # "9 1 2" is not stored
    assert trie.matches([3, 1, 2]) == [node(trie, [2]), node(trie, [1, 2]), node(trie, [3, 1, 2])]
    assert trie.matches([2, 3, 1, 2]) == trie.matches([3, 1, 2])  # at most max_depth - 1 tokens
    assert trie.matches([7]) == [] and SuffixTrie(4).matches([1, 2]) == []


def test_deepcopy_is_independent():
    trie = SuffixTrie(3)
    trie.add([1, 2, 1])
    other = copy.deepcopy(trie)
    other.add([1, 2, 2])
    assert count(trie, [1, 2]) == 1 and count(other, [1, 2]) == 2 and trie.sequences == 1
    assert all_counts(copy.deepcopy(trie)) == all_counts(trie)


def check_free_slots(trie: SuffixTrie) -> None:
    """Evicted nodes' slots hold nothing and no live node points at one."""
    assert all(trie.count[i] == 0 and trie.kids[i] is None for i in trie.free)
    live = {child for kids in trie.kids if kids for child in kids.values()}
    assert not live & set(trie.free) and len(set(trie.free)) == len(trie.free)


@pytest.mark.parametrize("seed", range(6))
def test_eviction_leaves_the_trie_of_the_outputs_kept(seed):
    """Random sequences stored under a bound of k: the oldest are evicted first in, first out, and the
    counts are then exactly those of the last k sequences (a brute-force count), with no node left over.
    Negative control: without the bound every sequence is still counted."""
    rng = random.Random(seed)
    depth, bound = rng.randrange(2, 7), rng.randrange(1, 4)
    sequences = [[rng.randrange(3) for _ in range(rng.randrange(0, 30))] for _ in range(bound + 4)]
    bounded, unbounded = SuffixTrie(depth, max_sequences=bound), SuffixTrie(depth)
    for i, seq in enumerate(sequences, 1):
        bounded.add(seq)
        unbounded.add(seq)
        kept = sequences[max(0, i - bound):i]
        assert list(bounded.stored) == kept and bounded.evicted == i - len(kept) and bounded.sequences == i
        expected = brute_counts(kept, depth)
        assert all_counts(bounded) == expected and len(bounded) == 1 + len(expected)
        assert bounded.count[0] == sum(map(len, kept))
        check_free_slots(bounded)
    assert bounded.evicted == 4
    assert all_counts(unbounded) == brute_counts(sequences, depth) and unbounded.evicted == 0
    assert all_counts(unbounded) != all_counts(bounded)


def test_evicted_slots_are_reused():
    """One sequence stored again and again under a bound of 1: the trie never grows past its first size."""
    trie = SuffixTrie(4, max_sequences=1)
    trie.add([1, 2, 3, 1, 2])
    size = len(trie.count)
    for _ in range(5):
        trie.add([1, 2, 3, 1, 2])
        assert len(trie.count) == size and trie.free == []
    trie.add([7])
    assert len(trie) == 2 and len(trie.free) == size - 2  # the root and "7", in a reused slot
    check_free_slots(trie)
    other = copy.deepcopy(trie)
    other.add([8, 9])
    assert list(trie.stored) == [[7]] and list(other.stored) == [[8, 9]] and count(trie, [7]) == 1


# ---- the speculation tree ------------------------------------------------------------------------
# 5 is followed by 1 three times (then 9, 9, 8) and by 2 once: the hand-computed path probabilities
# after "5": 1: 3/4, 1 9: 3/4 * 2/3, 1 9 5: * 2/2, 2: 1/4, 1 8: 3/4 * 1/3, 2 9: 1/4 * 1/1, 1 8 5: 1/4.
FREQ = [5, 1, 9, 5, 1, 9, 5, 1, 8, 5, 2, 9]


def freq_trie(depth: int = 4) -> SuffixTrie:
    trie = SuffixTrie(depth)
    trie.add(FREQ)
    return trie


def test_tree_grows_best_first_by_path_probability():
    """Each node joins in order of its path probability; ties (2 and 1 8, both 1/4) in the order
    they were found; parents always before children. The trie's depth (4) stops 1 9 5 and 1 8 5."""
    d = grow(freq_trie(), node(freq_trie(), [5]), size=10, depth=10, min_prob=0.0, stop_ids=set())
    assert d.tokens == [1, 9, 5, 2, 8, 9, 5]
    assert d.parents == [0, 1, 2, 0, 1, 4, 5]
    assert d.probs == pytest.approx([3 / 4, 1 / 2, 1 / 2, 1 / 4, 1 / 4, 1 / 4, 1 / 4])
    assert d.score == pytest.approx(2.75)


def test_tree_is_cut_by_size_probability_depth_and_stop_tokens():
    trie = freq_trie()
    at = node(trie, [5])
    assert grow(trie, at, 3, 10, 0.0, set()).tokens == [1, 9, 5]  # the 3 most likely nodes
    assert grow(trie, at, 10, 10, 0.3, set()).tokens == [1, 9, 5]  # the 1/4 ones are under min_token_prob
    assert grow(trie, at, 10, 10, 0.25, set()).tokens == [1, 9, 5, 2, 8, 9, 5]  # at it: kept (exact in binary)
    assert grow(trie, at, 10, 1, 0.0, set()).tokens == [1, 2]  # one level (room)
    assert grow(trie, at, 10, 10, 0.0, {9}).tokens == [1, 9, 2, 8, 9, 5]  # nothing after a stop token
    assert grow(trie, at, 10, 10, 0.9, set()).tokens == []
    deeper = grow(trie, node(trie, [5, 1]), 10, 10, 0.0, set())  # a match of 2 drafts at most 4 - 2 deep
    assert deeper.tokens == [9, 5, 8, 5] and deeper.parents == [0, 1, 0, 3]
    assert deeper.probs == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])


# 1..8 then 0 1..5: as the request's trie holds it, the context (its end) matches 5 tokens back; each
# match's node counts the context's own occurrence too, so every continuation has probability 1/2.
REPEAT = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5]


def request_candidates(depth: int = 24):
    trie = SuffixTrie(depth)
    open_ = trie.extend([], REPEAT)
    return [("request", trie, open_)]


def test_draft_size_is_alpha_times_the_match():
    """The longest useful match is 5 tokens (1 2 3 4 5; 0 1 2 3 4 5 occurs only at the end): alpha = 1
    drafts 5 nodes, 0.4 two (int(0.4 * 5)), 2 the 9 there are; max_spec_tokens caps them all."""
    d = best_draft(request_candidates(), alpha=1.0, max_spec_tokens=24, depth=30, min_prob=0.1, stop_ids=set())
    assert (d.match, d.source, d.tokens) == (5, "request", [6, 7, 8, 0, 1])
    assert d.parents == [0, 1, 2, 3, 4] and d.probs == pytest.approx([0.5] * 5)
    assert best_draft(request_candidates(), 0.4, 24, 30, 0.1, set()).tokens == [6, 7]
    assert best_draft(request_candidates(), 2.0, 24, 30, 0.1, set()).tokens == [6, 7, 8, 0, 1, 2, 3, 4, 5]
    assert best_draft(request_candidates(), 2.0, 3, 30, 0.1, set()).tokens == [6, 7, 8]
    # max_depth 8: a match of 5 drafts 3 deep (score 1.5); one of 3 drafts 5 deep and scores more (2.5)
    cut = best_draft(request_candidates(8), 2.0, 24, 30, 0.1, set())
    assert (cut.match, cut.tokens) == (3, [6, 7, 8, 0, 1]) and cut.score == pytest.approx(2.5)
    assert best_draft(request_candidates(), 1.0, 24, 30, 0.6, set()).tokens == []  # 1/2 < min_token_prob
    assert best_draft(request_candidates(), 1.0, 24, 2, 0.1, set()).tokens == [6, 7]  # room


def test_the_highest_score_wins_across_tries():
    """A global trie that saw 5 always followed by 1 9 (score 1 + 1 + 1/2) outscores the request's
    weaker match (3/4 + 1/2 + 1/2 + 1/4); with the scores tied the earlier trie (the request's) keeps it."""
    strong = SuffixTrie(4)
    strong.add([5, 1, 9, 5, 1, 9])
    weak = freq_trie()
    context = [7, 5]
    cands = [("request", weak, weak.matches(context)), ("global", strong, strong.matches(context))]
    d = best_draft(cands, 4.0, 24, 10, 0.0, set())
    assert (d.source, d.match, d.tokens) == ("global", 1, [1, 9, 5])
    assert d.probs == pytest.approx([1, 1, 1 / 2])  # 5 1 9 goes on with 5 once of twice
    assert best_draft(cands[:1], 4.0, 24, 10, 0.0, set()).score == pytest.approx(2.0)
    same = [("request", strong, strong.matches(context)), ("global", strong, strong.matches(context))]
    assert best_draft(same, 4.0, 24, 10, 0.0, set()).source == "request"


# ---- settings ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, message", [
    ("alpha", 0, "decoder.alpha must be a number > 0"),
    ("alpha", True, "decoder.alpha must be a number > 0"),
    ("min_token_prob", 1.5, "decoder.min_token_prob must be a number >= 0 and <= 1"),
    ("max_spec_tokens", 0, "decoder.max_spec_tokens must be an integer >= 1"),
    ("max_depth", 1, "decoder.max_depth must be an integer >= 2"),
    ("use_global", "yes", "decoder.use_global must be one of True, False"),
    ("max_cached_requests", 0, "decoder.max_cached_requests must be an integer >= 1 or None"),
    ("max_spec_tokens", 5000, "1 + max_spec_tokens 5000"),
])
def test_bad_settings_are_refused_in_one_line(key, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Suffix(**{key: value})


# ---- the global trie -------------------------------------------------------------------------------
PROMPT = [7, 8, 9]  # on tiny_lm(seed=0): a 40-token greedy output that barely repeats itself


def test_a_repeated_request_drafts_long_from_the_global_trie():
    """The second decoding of a prompt drafts its output from the first one's, held by the global trie:
    a few steps, most drafts from it. Negative control: without the global trie, the second decoding
    is the first one again, step for step."""
    lm = tiny_lm(seed=0)
    reference = autoregressive_decode(lm, PROMPT, 40, GREEDY, set()).tokens
    for use_global in (True, False):
        decoder = Suffix(use_global=use_global)
        first = decoder.generate(lm, PROMPT, 40, GREEDY, set())
        again = decoder.generate(lm, PROMPT, 40, GREEDY, set())
        assert first.tokens == again.tokens == reference
        assert len(first.steps) >= 30  # the output alone gives little to draft from
        if use_global:
            assert decoder.carried(lm)["global"].sequences == 2  # both outputs, learnt once each when finished
            assert len(again.steps) <= 8 and sum(s.accepted_draft_tokens for s in again.steps) >= 30
            assert sum(s.info["from_global"] for s in again.steps) >= 4
            assert max(s.info["match_length"] for s in again.steps) >= 8
        else:
            assert decoder.carried(lm) == {}
            assert [s.info for s in again.steps] == [s.info for s in first.steps]
            assert not any(s.info["from_global"] for s in again.steps)


def test_the_global_trie_is_per_target_and_learns_only_outputs():
    lm, other = tiny_lm(seed=0), tiny_lm(seed=1)
    decoder = Suffix()
    out = decoder.generate(lm, PROMPT, 12, GREEDY, set())
    trie = decoder.carried(lm)["global"]
    assert trie.count[0] == 12 and trie.sequences == 1  # the output's 12 tokens, not the prompt's
    assert count(trie, out.tokens[:3]) >= 1 and count(trie, PROMPT) == 0
    assert isinstance(decoder, CarriesState)
    decoder.generate(other, PROMPT, 12, GREEDY, set())
    assert decoder.carried(other)["global"].sequences == 1  # a new target starts empty


def test_an_output_cut_at_a_stop_token_is_learnt_to_its_end():
    lm = tiny_lm(seed=0)
    free = autoregressive_decode(lm, PROMPT, 40, GREEDY, set()).tokens
    stop = {free[5]}
    decoder = Suffix()
    out = decoder.generate(lm, PROMPT, 40, GREEDY, stop)
    assert out.tokens == free[:free.index(free[5]) + 1]
    assert decoder.carried(lm)["global"].count[0] == len(out.tokens)


def test_an_evicted_output_is_no_longer_drafted_from():
    """PROMPT, another prompt, then PROMPT again. With a bound of 1 the other prompt's output evicts
    PROMPT's first one, so the third decoding drafts as the first did (nothing of its output is left);
    with a bound of 2 (the negative control) it drafts it from the global trie in a few steps. Every
    output equals autoregressive's."""
    lm = tiny_lm(seed=0)
    reference = autoregressive_decode(lm, PROMPT, 40, GREEDY, set()).tokens
    other = [1, 2, 3, 4]
    for bound in (1, 2):
        decoder = Suffix(max_cached_requests=bound)
        first = decoder.generate(lm, PROMPT, 40, GREEDY, set())
        decoder.generate(lm, other, 40, GREEDY, set())
        again = decoder.generate(lm, PROMPT, 40, GREEDY, set())
        trie = decoder.carried(lm)["global"]
        assert first.tokens == again.tokens == reference
        assert trie.sequences == 3 and trie.evicted == 3 - bound and len(trie.stored) == bound
        if bound == 1:
            assert not any(s.info["from_global"] and s.info["match_length"] >= 8 for s in again.steps)
            assert len(again.steps) >= 30
        else:
            assert len(again.steps) <= 8 and max(s.info["match_length"] for s in again.steps) >= 8


# ---- repeats stay repeats ---------------------------------------------------------------------------
def test_carry_puts_the_global_trie_back_so_a_rerun_drafts_as_the_first_run():
    """The runner's mechanism (contract.carried_copy / carry, and kept_as_is for warm-ups): a prompt
    rerun from the state its first run started from drafts exactly as that run did; left as the
    first run left it, it drafts from its own output (the failure this guards against)."""
    lm = tiny_lm(seed=0)
    decoder = Suffix()
    with kept_as_is(decoder, lm):  # a warm-up on the same prompt leaves nothing behind
        decoder.generate(lm, PROMPT, 40, GREEDY, set())
    assert decoder.carried(lm) == {}
    decoder.generate(lm, [1, 2, 3, 4], 20, GREEDY, set())  # an earlier prompt: the global trie is not empty
    before = carried_copy(decoder, lm)
    first = decoder.generate(lm, PROMPT, 40, GREEDY, set())
    carry(decoder, lm, before)
    repeat = decoder.generate(lm, PROMPT, 40, GREEDY, set())
    assert [s.info for s in repeat.steps] == [s.info for s in first.steps]
    unrestored = decoder.generate(lm, PROMPT, 40, GREEDY, set())
    assert len(unrestored.steps) < len(first.steps) // 3


@pytest.mark.slow
def test_timed_repeats_draft_as_their_first_run(tmp_path, monkeypatch):
    """The leaderboard's timed repeats (bench/leaderboard_run.py: time_prompt): every repeat of a
    prompt starts from the global trie its first run started from and drafts step for step as it did;
    the next prompt starts from the trie the first run left. Negative control: with the runner's
    put-back (carry) disabled, the second repeat drafts from the first one's output and the same
    check fails."""
    from bench import leaderboard, leaderboard_run

    def runs(carry_back: bool) -> list[tuple[list[int], int, list[dict]]]:
        logged = []
        generate = Suffix.generate

        def logging(self, lm, prompt_ids, *args):
            sequences = self.carried(lm).get("global", SuffixTrie(2)).sequences
            gen = generate(self, lm, prompt_ids, *args)
            logged.append((list(prompt_ids), sequences, [s.info for s in gen.steps]))
            return gen

        with monkeypatch.context() as m:
            m.setattr(Suffix, "generate", logging)
            if not carry_back:
                m.setattr(leaderboard_run, "carry", lambda decoder, lm, state: None)
            _, labels, board = leaderboard.compose_all(
                ["model=tiny-random", "leaderboard.only=[autoregressive,suffix]", "leaderboard.datasets=[gsm8k]",
                 "leaderboard.limit=2", "leaderboard.repeats=3", "gen.max_new_tokens=24", "quality=false",
                 "progress=false", "warmup=false"])
            leaderboard_run.run_dataset("gsm8k", labels, board, tmp_path / str(carry_back), {}, repeats=3)
        return logged

    def repeats_agree(logged) -> bool:
        first, second = logged[:3], logged[3:]
        return all(run == group[0] for group in (first, second) for run in group)

    logged = runs(carry_back=True)
    assert len(logged) == 6  # 2 prompts x 3 repeats
    assert [n for _, n, _ in logged] == [0, 0, 0, 1, 1, 1]  # the second prompt: the first one's output learnt
    assert repeats_agree(logged)
    assert not repeats_agree(runs(carry_back=False))


def test_batched_rows_are_lossless_and_all_learnt():
    """Rows of a batch share the global trie (each row's output joins it when the row finishes, so a
    row's drafts may differ from its batch-1 ones): every row still equals autoregressive greedy."""
    from decoders.core.batch import decode_batch

    lm = tiny_lm(seed=0)
    prompts = [PROMPT, [1, 2, 3, 1, 2], PROMPT, [9]]
    decoder = Suffix()
    decoder.generate(lm, PROMPT, 24, GREEDY, set())  # a global trie holding PROMPT's output
    gens, _ = decode_batch(decoder, lm, prompts, 24, [GREEDY] * len(prompts), set())
    for prompt, gen in zip(prompts, gens):
        assert gen.tokens == autoregressive_decode(lm, prompt, 24, GREEDY, set()).tokens
    assert decoder.carried(lm)["global"].sequences == 1 + len(prompts)
    assert len(gens[0].steps) < 12  # the repeated prompt drafts from the first decoding's output


def test_batched_rows_under_the_bound_are_lossless():
    """A bound of 2 outputs: rows finishing in a batch evict one another's outputs as they join;
    every row still equals autoregressive greedy, and the trie holds the last two outputs learnt."""
    from decoders.core.batch import decode_batch

    lm = tiny_lm(seed=0)
    prompts = [PROMPT, [1, 2, 3, 1, 2], PROMPT, [9], [4, 4, 4]]
    decoder = Suffix(max_cached_requests=2)
    decoder.generate(lm, PROMPT, 24, GREEDY, set())
    gens, _ = decode_batch(decoder, lm, prompts, 24, [GREEDY] * len(prompts), set())
    for prompt, gen in zip(prompts, gens):
        assert gen.tokens == autoregressive_decode(lm, prompt, 24, GREEDY, set()).tokens
    trie = decoder.carried(lm)["global"]
    assert trie.sequences == 1 + len(prompts) and trie.evicted == len(prompts) - 1 and len(trie.stored) == 2
    assert all_counts(trie) == brute_counts(trie.stored, trie.max_depth)
    check_free_slots(trie)
