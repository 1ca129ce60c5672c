"""transformers' own decoding loops as peer baselines (traced by core.hf_trace.hf_generate)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.contract import PerTarget, check, check_step
from .draft_model import DRAFT_REQUIRED, build_draft
from ..core.hf_trace import hf_generate
from ..core.lm import LM
from ..core.sampling import Sampling
from ..core.trace import Generation

RUNS_TORCH = {"weights": "transformers' generate() runs the target's torch model"}  # contract.check_engine


@dataclass
class HFGenerate:
    """model.generate(): greedy or sampling, DynamicCache, no assistant."""

    target_needs = RUNS_TORCH
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        return hf_generate(lm, prompt_ids, max_new_tokens, sampling, stop_ids)


@dataclass
class HFPromptLookup:
    """Prompt lookup decoding in generate(): candidates are copied from the context after
    the longest matching n-gram (up to max_ngram) and verified in one pass."""

    target_needs = RUNS_TORCH
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    num_tokens: int = 10  # prompt_lookup_num_tokens: candidate length
    max_ngram: int = 2  # max_matching_ngram_size

    def __post_init__(self):
        check("num_tokens", self.num_tokens, at_least=1)
        check("max_ngram", self.max_ngram, at_least=1)
        self.widest_step = check_step(1 + self.num_tokens, f"1 + num_tokens {self.num_tokens}")

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        return hf_generate(lm, prompt_ids, max_new_tokens, sampling, stop_ids,
                           prompt_lookup_num_tokens=self.num_tokens, max_matching_ngram_size=self.max_ngram)


@dataclass
class HFAssisted:
    """Assisted generation in generate() with the same draft as our draft-model decoders
    (the peer of spec_chain / sequoia). Only the target's forwards are traced as steps."""

    draft: Any = None  # draft=self or a model config
    num_assistant_tokens: int | None = None  # null: transformers' default (and its heuristic schedule)
    target_needs = RUNS_TORCH
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    _drafts: PerTarget = field(default_factory=PerTarget, repr=False, compare=False)

    def __post_init__(self):
        check("draft", self.draft, required=DRAFT_REQUIRED)
        check("num_assistant_tokens", self.num_assistant_tokens, at_least=1, also=(None,))
        if self.num_assistant_tokens is not None:
            n = self.num_assistant_tokens
            self.widest_step = check_step(1 + n, f"1 + num_assistant_tokens {n}")

    def load_addons(self, lm: LM) -> LM:
        return self._drafts.get(lm, lambda: build_draft(self.draft, lm))

    def generate(self, lm: LM, prompt_ids, max_new_tokens: int, sampling: Sampling, stop_ids) -> Generation:
        extra = {} if self.num_assistant_tokens is None else {"num_assistant_tokens": self.num_assistant_tokens}
        return hf_generate(lm, prompt_ids, max_new_tokens, sampling, stop_ids, assistant=self.load_addons(lm), **extra)
