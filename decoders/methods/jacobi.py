"""Jacobi decoding (Santilli et al. 2023): guess a block of m future tokens, run them through
the target in one pass, keep the prefix that equals the target's own predictions, and feed
the predictions back as the next guesses until the block converges.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from ..core.contract import check, check_step, decode_one
from ..core.lm import LM
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler
from ..core.tree import TokenTree

GUESS_INITS = ("prompt", "vocab", "repeat")


def initial_guesses(init: str, count: int, context: Sequence[int], vocab_size: int, rng: random.Random) -> list[int]:
    """Tokens for positions nothing has predicted yet.

    prompt: drawn from the context so far (lade's choice: likely tokens, no vocabulary-sized noise);
    vocab: uniform over the vocabulary; repeat: the last context token.
    """
    if init == "prompt":
        return [context[rng.randrange(len(context))] for _ in range(count)]
    if init == "vocab":
        return [rng.randrange(vocab_size) for _ in range(count)]
    return [context[-1]] * count


class JacobiWindow:
    """The proposer: a chain of `block_size` guesses after the root, from the first step (the
    prompt is fed with them). The target's predictions past the accepted prefix become the next
    guesses; positions nothing predicted yet are guessed afresh."""

    waits_for_prefill = False

    def __init__(self, block_size: int, init: str, prompt: Sequence[int], vocab_size: int, seed: int):
        self.block_size, self.init, self.vocab_size = block_size, init, vocab_size
        self.rng = random.Random(seed)
        self.guesses = initial_guesses(init, block_size, list(prompt), vocab_size, self.rng)

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        return Proposal(TokenTree.chain(sequence[-1], self.guesses))

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        following = scores.argmax(len(path), len(scores.logits))
        fresh = initial_guesses(self.init, self.block_size, list(sequence), self.vocab_size, self.rng)
        self.guesses = (following + fresh)[:self.block_size]
        return {}


@dataclass
class Jacobi:
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    block_size: int = 8  # m: future positions guessed and refined per pass
    init: str = "prompt"  # how fresh positions are guessed: prompt | vocab | repeat

    def __post_init__(self):
        check("block_size", self.block_size, at_least=1)
        check("init", self.init, one_of=GUESS_INITS)
        self.widest_step = check_step(1 + self.block_size, f"1 + block_size {self.block_size}")

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        return JacobiWindow(self.block_size, self.init, prompt_ids, lm.vocab_size, sampler.sampling.seed), None

    generate = decode_one  # one prompt through the shared loop
