"""Jacobi decoding (Santilli et al. 2023): guess a block of m future tokens, run them through
the target in one pass, keep the prefix that equals the target's own predictions, and feed
the predictions back as the next guesses until the block converges.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from .lm import LM
from .sampling import Sampling, probs
from .trace import Generation, Tracer, truncate_at_stop
from .tree import TokenTree
from .verify import verify_greedy, verify_sampling

GUESS_INITS = ("prompt", "vocab", "repeat")


def check_init(init: str) -> None:
    if init not in GUESS_INITS:
        raise ValueError(f"decoder.init must be one of {', '.join(GUESS_INITS)}, got {init!r}")


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


def commit(tokens: list[int], new: list[int], stop_ids, max_new_tokens: int) -> int:
    """Append the step's tokens, cut at a stop token and at max_new_tokens; returns how many were kept."""
    kept = truncate_at_stop(new, stop_ids, max_new_tokens - len(tokens))
    tokens.extend(kept)
    return len(kept)


def done(tokens: list[int], stop_ids, max_new_tokens: int) -> bool:
    return len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in stop_ids)


def jacobi_decode(lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, stop_ids,
                  block_size: int, init: str = "prompt") -> Generation:
    tracer = Tracer(lm.sync)
    cache = lm.new_cache()
    warpers = sampling.warpers()
    generator = sampling.generator(lm.device)
    rng = random.Random(sampling.seed)
    prompt = list(prompt_ids)
    tokens: list[int] = []
    feed = prompt  # committed tokens not yet in the cache; the last one is the block's root
    guesses = initial_guesses(init, block_size, prompt, lm.vocab_size, rng)
    while True:
        context = len(cache)
        tree = TokenTree.chain(feed[-1], guesses)
        with tracer.target():
            # Causal over [uncached committed tokens, guesses]: a chain needs no custom mask.
            logits = lm.forward(feed[:-1] + tree.tokens, cache, logits_last=len(tree))
        if sampling.greedy:
            path, bonus = verify_greedy(tree, logits)
        else:
            path, bonus = verify_sampling(tree, probs(logits, sampling, warpers), None, generator)
        drafted = [tree.tokens[i] for i in path[1:]]
        accepted = commit(tokens, drafted + [bonus], stop_ids, max_new_tokens)
        tracer.end_step(accepted=accepted, forward_tokens=len(feed) - 1 + len(tree), context_tokens=context,
                        draft_tokens=len(guesses), accepted_draft_tokens=min(len(drafted), accepted))
        if done(tokens, stop_ids, max_new_tokens):
            return tracer.finish(tokens, stop_ids)
        # Keep the cache of the accepted prefix only (a chain: cropping is enough).
        cache.crop(context + len(feed) + len(drafted))
        # The Jacobi update: the predictions after the accepted prefix become the next guesses.
        following = logits[len(path):].argmax(dim=-1).tolist()
        guesses = (following + initial_guesses(init, block_size, prompt + tokens, lm.vocab_size, rng))[:block_size]
        feed = [bonus]


@dataclass
class Jacobi:
    name: str = "jacobi"
    lossless: bool = True
    block_size: int = 8  # m: future positions guessed and refined per pass
    init: str = "prompt"  # how fresh positions are guessed: prompt | vocab | repeat

    def __post_init__(self):
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"decoder.block_size must be an integer >= 1, got {self.block_size!r}")
        check_init(self.init)

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        return jacobi_decode(lm, prompt_ids, max_new_tokens, sampling, stop_ids, self.block_size, self.init)
