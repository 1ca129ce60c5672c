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

from .jacobi import check_init, commit, done, initial_guesses
from .lm import LM
from .lookahead_tuning import AUTO, tune
from .ngram_pool import NGramPool
from .sampling import Sampling, probs
from .trace import Generation, Tracer
from .tree import TokenTree
from .verify import verify_greedy, verify_sampling


def window_mask(levels: int, width: int) -> torch.Tensor:
    """(levels*W, levels*W) bool among lookahead guesses, level-major: (l, j) sees (0, <=j) and (1..l, j)."""
    n = levels * width
    mask = torch.zeros(n, n, dtype=torch.bool)
    level0 = torch.tril(torch.ones(width, width, dtype=torch.bool))
    for l in range(levels):
        rows = slice(l * width, (l + 1) * width)
        mask[rows, :width] = level0
        for k in range(1, l + 1):
            mask[rows, k * width:(k + 1) * width] |= torch.eye(width, dtype=torch.bool)
    return mask


def step_inputs(cache_len: int, uncached: int, levels: int, width: int, tree: TokenTree,
                branch_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (q, cache + q) and positions for [uncached committed tokens, window, trie nodes after the root]."""
    c, u, lw, t = cache_len, uncached, levels * width, len(tree) - 1
    q = u + lw + t
    mask = torch.zeros(q, c + q, dtype=torch.bool)
    mask[:, :c] = True
    mask[:u, c:c + u] = torch.tril(torch.ones(u, u, dtype=torch.bool))
    mask[u:, c:c + u] = True  # both branches follow every committed token
    mask[u:u + lw, c + u:c + u + lw] = branch_mask
    mask[u + lw:, c + u + lw:] = tree.ancestor_mask()[1:, 1:]
    root = c + u - 1
    offsets = torch.arange(levels)[:, None] + torch.arange(width)[None, :] + 1
    positions = torch.cat([torch.arange(c, c + u), root + offsets.flatten(),
                           root + torch.tensor(tree.depths[1:], dtype=torch.long)])
    return mask, positions


def lookahead_decode(lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, stop_ids,
                     window: int, ngram: int, guess_set_size: int, pool_from_prompt: bool = True,
                     pool_from_output: bool = True, init: str = "prompt") -> Generation:
    tracer = Tracer(lm.sync)
    cache = lm.new_cache()
    warpers = sampling.warpers()
    generator = sampling.generator(lm.device)
    rng = random.Random(sampling.seed)
    prompt = list(prompt_ids)
    tokens: list[int] = []
    pool = NGramPool(ngram, guess_set_size)
    if pool_from_prompt:
        pool.add_from(prompt)
    # Level 0 is guessed; level l fills at step l (the Jacobi iterates of level 0), then the window slides.
    levels = [initial_guesses(init, window, prompt, lm.vocab_size, rng)]
    branch_masks = {}
    feed = prompt  # committed tokens not yet in the cache; the last one is the root of both branches
    while True:
        context = len(cache)
        with tracer.draft():
            grams = pool.candidates(feed[-1])
            tree = TokenTree.from_sequences(feed[-1], grams)
            if len(levels) not in branch_masks:
                branch_masks[len(levels)] = window_mask(len(levels), window)
            mask, positions = step_inputs(context, len(feed), len(levels), window, tree, branch_masks[len(levels)])
            branch = [t for level in levels for t in level]
        u, lw = len(feed), len(branch)
        # Logits only where they are used: the root, the newest window level, the trie.
        rows = [u - 1, *range(u + lw - window, u + lw), *range(u + lw, u + lw + len(tree) - 1)]
        with tracer.target():
            logits = lm.forward(feed + branch + tree.tokens[1:], cache, position_ids=positions, mask=mask,
                                logits_rows=rows)
        tree_logits = torch.cat([logits[:1], logits[1 + window:]])
        if sampling.greedy:
            path, bonus = verify_greedy(tree, tree_logits)
        else:
            path, bonus = verify_sampling(tree, probs(tree_logits, sampling, warpers), None, generator)
        with tracer.draft():
            newest = logits[1:1 + window].argmax(dim=-1).tolist()
            if len(levels) < ngram - 1:
                levels.append(newest)
            else:
                for j in range(window):  # column j, read down the levels, plus its new prediction
                    pool.add(levels[0][j], [level[j] for level in levels[1:]] + [newest[j]])
                levels = levels[1:] + [newest]
        drafted = [tree.tokens[i] for i in path[1:]]
        before = len(tokens)
        accepted = commit(tokens, drafted + [bonus], stop_ids, max_new_tokens)
        if pool_from_output:
            pool.add_from(prompt + tokens, start=len(prompt) + before - ngram + 1)
        tracer.end_step(accepted=accepted, forward_tokens=len(feed) + len(branch) + len(tree) - 1,
                        context_tokens=context, draft_tokens=len(tree) - 1,
                        accepted_draft_tokens=min(len(drafted), accepted),
                        info={"pool": len(pool), "candidates": len(grams), "hit": bool(drafted)})
        if done(tokens, stop_ids, max_new_tokens):
            return tracer.finish(tokens, stop_ids)
        offset = context + len(feed) + len(branch) - 1  # cache index of trie node i is offset + i
        cache.keep(list(range(context + len(feed))) + [offset + i for i in path[1:]])
        feed = [bonus]


def _check(name: str, value, low: int, allow=()) -> None:
    if any(value == a and type(value) is type(a) for a in allow):
        return
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        extra = "".join(f" or {a}" for a in allow)
        raise ValueError(f"decoder.{name} must be an integer >= {low}{extra}, got {value!r}")


@dataclass
class Lookahead:
    name: str = "lookahead"
    lossless: bool = True
    window: int | str = 5  # W: guesses per level of the lookahead branch; "auto" = chosen for this device
    ngram: int | str = 4  # N: n-gram size; the window holds N-1 levels; "auto" as W
    guess_set_size: int | str = 5  # G: n-grams verified per step and kept per key; -1 = unbounded; "auto" = W
    pool_from_prompt: bool = True  # seed the pool with the prompt's n-grams
    pool_from_output: bool = True  # add the output's n-grams as they are committed
    init: str = "prompt"  # initial window guesses: prompt | vocab | repeat
    # "auto": the grid searched, the calibration (first prompts of the dataset, greedy), the cache.
    auto_windows: tuple = (1, 2, 3, 5)
    auto_ngrams: tuple = (3, 4, 5, 6)
    auto_prompts: int = 3
    auto_tokens: int = 48
    cache_dir: str | None = None  # where the latency profile and calibration table are kept; None = not kept

    def __post_init__(self):
        _check("window", self.window, 1, allow=(AUTO,))
        _check("ngram", self.ngram, 2, allow=(AUTO,))
        _check("guess_set_size", self.guess_set_size, 0, allow=(-1, AUTO))
        check_init(self.init)
        self.auto_windows, self.auto_ngrams = tuple(self.auto_windows), tuple(self.auto_ngrams)
        for w in self.auto_windows:
            _check("auto_windows[]", w, 1)
        for n in self.auto_ngrams:
            _check("auto_ngrams[]", n, 2)
        _check("auto_prompts", self.auto_prompts, 1)
        _check("auto_tokens", self.auto_tokens, 1)
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
        self.tuning = tune(lm, [list(p) for p in prompts[:self.auto_prompts]], stop_ids, self.window, self.ngram,
                           self.guess_set_size, self.auto_windows, self.auto_ngrams, self.auto_tokens, self.cache_dir,
                           sampling=sampling, pool_from_prompt=self.pool_from_prompt,
                           pool_from_output=self.pool_from_output, init=self.init)

    def setting(self) -> tuple[int, int, int]:
        if self.tuning is not None:
            return self.tuning["window"], self.tuning["ngram"], self.tuning["guess_set_size"]
        return self.window, self.ngram, self.guess_set_size

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        if self.calibration_prompts:  # used without the runner: calibrate on this prompt
            self.prepare(lm, [list(prompt_ids)], stop_ids, sampling)
        window, ngram, guess_set_size = self.setting()
        return lookahead_decode(lm, prompt_ids, max_new_tokens, sampling, stop_ids, window, ngram, guess_set_size,
                                self.pool_from_prompt, self.pool_from_output, self.init)
