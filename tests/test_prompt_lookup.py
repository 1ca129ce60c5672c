"""Prompt lookup's search (decoders/methods/prompt_lookup.py): the earliest earlier occurrence of the
longest suffix n-gram, as a plain scan over every position finds it, at a cost that does not grow with a
Python loop over the context. Its speed beside hf_pld's: results/reference/prompt_lookup_search/."""
import random
import time

import numpy as np
import pytest

from decoders.methods.prompt_lookup import PromptLookup, earliest_continuation


def scan(sequence: list[int], max_ngram: int) -> int | None:
    """The definition, position by position."""
    for n in range(min(max_ngram, len(sequence) - 1), 0, -1):
        suffix = sequence[-n:]
        for i in range(len(sequence) - n):
            if sequence[i:i + n] == suffix:
                return i + n
    return None


@pytest.mark.parametrize("vocab", [2, 5, 50])
@pytest.mark.parametrize("max_ngram", [1, 2, 4])
def test_the_search_finds_what_a_scan_finds(vocab, max_ngram):
    rng = random.Random(vocab * 10 + max_ngram)
    for length in [1, 2, 3, 5, 8, 30, 200]:
        for _ in range(20):
            sequence = [rng.randrange(vocab) for _ in range(length)]
            assert earliest_continuation(np.array(sequence), max_ngram) == scan(sequence, max_ngram), sequence


def test_the_proposer_follows_a_growing_text_and_a_new_one():
    """Steps append to the committed text (only the new tokens are converted); a shorter or another text
    is converted whole; the drafts are the tokens after the match, cut at a stop token."""
    rng = random.Random(0)
    proposer, sequence = PromptLookup(num_tokens=3, max_ngram=2, stop_ids={7}), []
    for step in range(300):
        sequence += [rng.randrange(12) for _ in range(rng.randrange(1, 4))]
        if step in (100, 200):  # another text of the same length and a shorter one
            sequence = [rng.randrange(12) for _ in range(len(sequence) - 50 * (step == 200))]
        start = scan(sequence, 2)
        expected = [] if start is None else sequence[start:start + 3]
        expected = expected[:expected.index(7)] if 7 in expected else expected
        tree = proposer.propose(sequence, room=5).tree
        assert tree.tokens == [sequence[-1], *expected], step


class CountingList(list):
    """A committed text that counts the tokens read from it."""
    read = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        CountingList.read += len(got) if isinstance(index, slice) else 1
        return got


def test_each_committed_token_is_read_once_not_once_a_step():
    """50 steps after a 4,000-token prompt without a match read the prompt once and then a few tokens a step;
    a search that compares the suffix at every position reads the whole text each step."""
    rng = random.Random(1)
    sequence, proposer = CountingList(rng.randrange(1000, 2000) for _ in range(4000)), PromptLookup(10, 2, set())
    CountingList.read = 0
    for step in range(50):
        sequence.append(step)  # a token the text never held: no match
        assert proposer.propose(sequence, room=10).tree.tokens == [step]
    assert CountingList.read <= 4000 + 50 * 4, CountingList.read


def test_a_step_at_4000_tokens_costs_well_under_a_millisecond():
    """The worst case, no match at any n-gram length: 0.1 ms or less a step on a Zen 4 (the benchmark), here
    bounded at 1 ms (the fastest of 20), where a scan in Python takes several."""
    rng = random.Random(2)
    sequence = [rng.randrange(1000, 2000) for _ in range(4000)]
    proposer = PromptLookup(10, 2, set())
    proposer.propose(sequence + [0], room=10)
    times = []
    for step in range(1, 21):
        sequence.append(step)
        start = time.perf_counter()
        proposer.propose(sequence, room=10)
        times.append(time.perf_counter() - start)
    assert min(times) < 1e-3, times
