"""Lookahead decoding (Fu, Bailis, Stoica, Zhang 2024), in one fused target pass per step.

Each step feeds the target, under one attention mask:
- the committed tokens not yet cached (the prompt at the first step, then the last token);
- the lookahead branch: a window of N-1 levels x W guesses, the last N-1 iterates of a Jacobi
  trajectory. Guess (l, j) sits at offset 1 + l + j after the last committed token and sees
  level 0's guesses 0..j and level 1..l's guesses in its own column j: a causal history, so
  column j reads as an n-gram (level 0..N-2 guesses, then the pass's prediction after
  (N-2, j)). The predictions after the last level become the next level; the oldest drops;
- the verification branch: the pool's (N-1)-grams that followed the last committed token,
  merged into a trie, each node seeing only its ancestors.
The branches cannot see each other. The trie is verified as a token tree (greedy: longest
match plus the target's bonus token, so up to N tokens per step; sampling: the
deterministic-candidate acceptance of verify_sampling), and the cache keeps only the
committed tokens' entries.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from ..core.contract import check, check_list, check_step, decode_one
from ..core.lm import LM
from ..core.loop import Proposal, Scores, SideBranch
from ..core.sampling import Sampler, Sampling
from ..core.tree import TokenTree
from ..tuning.lookahead_tuning import AUTO, tune
from .jacobi import GUESS_INITS, initial_guesses
from .ngram_pool import NGramPool


def window_mask(levels: int, width: int) -> torch.Tensor:
    """(levels*W, levels*W) bool among lookahead guesses, level-major: (l, j) sees (0, <=j) and (1..l, j)."""
    n = levels * width
    mask = torch.zeros(n, n, dtype=torch.bool)
    level0 = torch.tril(torch.ones(width, width, dtype=torch.bool))
    for level in range(levels):
        rows = slice(level * width, (level + 1) * width)
        mask[rows, :width] = level0
        for k in range(1, level + 1):
            mask[rows, k * width:(k + 1) * width] |= torch.eye(width, dtype=torch.bool)
    return mask


def window_offsets(levels: int, width: int) -> torch.Tensor:
    """Guess (l, j)'s position after the root: 1 + l + j (level-major)."""
    return (torch.arange(levels)[:, None] + torch.arange(width)[None, :] + 1).flatten()


class LookaheadWindow:
    """The proposer: the trie of the pool's n-grams after the root, verified; beside it, the
    window of Jacobi iterates, scored but not verified, whose columns become new n-grams."""

    waits_for_prefill = False  # the pool and the window start from the prompt

    def __init__(self, window: int, ngram: int, guess_set_size: int, prompt: Sequence[int], *, vocab_size: int,
                 seed: int, pool_from_prompt: bool = True, pool_from_output: bool = True, init: str = "prompt"):
        self.width, self.ngram, self.pool_from_output = window, ngram, pool_from_output
        self.pool = NGramPool(ngram, guess_set_size)
        if pool_from_prompt:
            self.pool.add_from(prompt)
        # Level 0 is guessed; level l fills at step l (the Jacobi iterates of level 0), then the window slides.
        self.levels = [initial_guesses(init, window, list(prompt), vocab_size, random.Random(seed))]
        self._masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # levels -> the window's mask, offsets
        self._candidates, self._committed = 0, 0  # this step's trie size and committed length, for commit()

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        grams = self.pool.candidates(sequence[-1])
        levels, width = len(self.levels), self.width
        if levels not in self._masks:
            self._masks[levels] = window_mask(levels, width), window_offsets(levels, width)
        mask, offsets = self._masks[levels]
        side = SideBranch(tokens=[t for level in self.levels for t in level], mask=mask, offsets=offsets,
                          rows=list(range((levels - 1) * width, levels * width)))
        self._candidates, self._committed = len(grams), len(sequence)
        return Proposal(TokenTree.from_sequences(sequence[-1], grams), side=side)

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        newest = scores.argmax(len(scores.logits))  # the side rows (on a GPU, read with verification's)
        if len(self.levels) < self.ngram - 1:
            self.levels.append(newest)
        else:
            for j in range(self.width):  # column j, read down the levels, plus its new prediction
                self.pool.add(self.levels[0][j], [level[j] for level in self.levels[1:]] + [newest[j]])
            self.levels = self.levels[1:] + [newest]
        if self.pool_from_output:  # the n-grams that end in this step's tokens
            self.pool.add_from(sequence, start=self._committed - self.ngram + 1)
        return {"pool": len(self.pool), "candidates": self._candidates, "hit": len(path) > 1}


@dataclass
class Lookahead:
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    window: int | str = 5  # W: guesses per level of the lookahead branch; "auto" = chosen for this device
    ngram: int | str = 4  # N: n-gram size; the window holds N-1 levels; "auto" as W
    guess_set_size: int | str = 5  # G: n-grams verified per step and kept per key; -1 = unbounded; "auto" = W
    pool_from_prompt: bool = True  # seed the pool with the prompt's n-grams
    pool_from_output: bool = True  # add the output's n-grams as they are committed
    init: str = "prompt"  # initial window guesses: prompt | vocab | repeat
    # "auto": the grid searched, the calibration (prompts past the scored ones), the cache.
    auto_windows: tuple = (1, 2, 3, 5)
    auto_ngrams: tuple = (3, 4, 5, 6)
    auto_prompts: int = 3
    auto_tokens: int = 48
    cache_dir: str | None = None  # where the latency profile and calibration table are kept; None = not kept

    def __post_init__(self):
        check("window", self.window, at_least=1, also=(AUTO,))
        check("ngram", self.ngram, at_least=2, also=(AUTO,))
        check("guess_set_size", self.guess_set_size, at_least=0, also=(-1, AUTO))
        check("init", self.init, one_of=GUESS_INITS)
        self.auto_windows = check_list("auto_windows", self.auto_windows, at_least=1)
        self.auto_ngrams = check_list("auto_ngrams", self.auto_ngrams, at_least=2)
        check("auto_prompts", self.auto_prompts, at_least=1)
        check("auto_tokens", self.auto_tokens, at_least=1)
        # the widest step its settings allow ("auto" at its largest candidate; G = -1 counted as W)
        w = max(self.auto_windows) if self.window == AUTO else self.window
        n = max(self.auto_ngrams) if self.ngram == AUTO else self.ngram
        g = w if self.guess_set_size in (AUTO, -1) else self.guess_set_size
        self.widest_step = check_step(1 + (n - 1) * (w + g), f"1 + (ngram {n} - 1) x (window {w} + guess_set_size {g})")
        self.tuning: dict | None = None  # the choice made for "auto", with its prediction

    @property
    def calibration_prompts(self) -> int:
        """Prompts the runner hands to prepare() (0: nothing to tune)."""
        auto = AUTO in (self.window, self.ngram, self.guess_set_size)
        return self.auto_prompts if auto and self.tuning is None else 0

    def prepare(self, lm: LM, prompts: list[list[int]], stop_ids, sampling: Sampling | None = None) -> None:
        """Resolve "auto" settings on this device and model, from these calibration prompts, at
        the run's sampling settings."""
        if not self.calibration_prompts:
            return

        def decode(ids, max_new_tokens, sampling, window, ngram, guess_set_size):
            fixed = Lookahead(window=window, ngram=ngram, guess_set_size=guess_set_size,
                              pool_from_prompt=self.pool_from_prompt,
                              pool_from_output=self.pool_from_output, init=self.init)
            return fixed.generate(lm, ids, max_new_tokens, sampling, stop_ids)
        self.tuning = tune(lm, [list(p) for p in prompts[:self.auto_prompts]], stop_ids, window=self.window,
                           ngram=self.ngram, guess_set_size=self.guess_set_size, windows=self.auto_windows,
                           ngrams=self.auto_ngrams, tokens=self.auto_tokens, run=decode, cache_dir=self.cache_dir,
                           sampling=sampling,
                           settings_key={"pool_from_prompt": self.pool_from_prompt,
                                         "pool_from_output": self.pool_from_output, "init": self.init})

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        if self.calibration_prompts:  # used without the runner: calibrate on this prompt
            self.prepare(lm, [list(prompt_ids)], stop_ids, sampler.sampling)
        settings = (self.window, self.ngram, self.guess_set_size) if self.tuning is None else (
            self.tuning["window"], self.tuning["ngram"], self.tuning["guess_set_size"])
        return LookaheadWindow(*settings, prompt_ids, vocab_size=lm.vocab_size, seed=sampler.sampling.seed,
                               pool_from_prompt=self.pool_from_prompt, pool_from_output=self.pool_from_output,
                               init=self.init), None

    generate = decode_one  # one prompt through the shared loop
