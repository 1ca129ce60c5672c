"""What a decoder is, what it may optionally do, and how its settings are checked.

The runner needs only `Decoder`. The optional capabilities are declared here once and looked
up with isinstance, so a new method opts in by having the members, with no base class:

    LoadsAddOns      load_addons(lm): drafts, heads, n-gram LMs built before any timing
    SelfTuning       calibration_prompts + prepare(...): tunes itself on unscored prompts
    ReportsTuning    tuning: what an automatic setting resolved to; records keep it
    Foresees         foresee(...): an untimed pass over each prompt before its clock (the oracle)
    CarriesState     carried(lm): state kept between prompts, put back around warm-ups and repeats
    Batches          proposer(...): runs in the shared loop, one prompt or B at a time
    DeclaresStep     widest_step: the most tokens one step feeds the target (the memory estimate's)
    greedy_only      a class attribute: True refuses gen.temperature > 0 (check_sampling)

and of the proposer a Batches decoder builds (loop.Proposer), one optional part:

    WaitsForPrefill  waits_for_prefill = True, with `hidden` and `feature_layers`: not asked at the
                     prefill, which scores the root alone asking for what later proposals read

check_proposer() and widest_step() refuse a method that has half of a part, in one line naming it.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar, runtime_checkable

from .lm import LM
from .loop import Accept, Proposer, speculative_decode
from .sampling import Sampler, Sampling
from .trace import Generation


@runtime_checkable
class Decoder(Protocol):
    name: str
    lossless: bool  # False for explicitly lossy variants (Medusa's typical acceptance); records say so

    def generate(self, lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                 stop_ids) -> Generation: ...


# What a decoder may read of its target beyond next-token logits. A decoder declares `target_needs`
# (capability -> why; a property where its settings decide, as draft=self does); an engine declares what
# it `gives` (the torch LM: everything; llama.cpp: decoders/core/llamacpp.py).
CAPABILITIES = {"hidden": "the last hidden state", "features": "a layer's output before the final norm",
                "weights": "the target's torch modules"}


def target_needs(decoder: Decoder) -> dict[str, str]:
    """What `decoder` reads of its target beyond logits, each with why (nothing: logits only)."""
    return dict(getattr(decoder, "target_needs", None) or {})


def check_engine(decoder: Decoder, gives: frozenset[str], engine: str) -> None:
    """One ValueError naming the first thing `decoder` needs that the engine does not give, and why it needs it."""
    for need, why in target_needs(decoder).items():
        if need not in gives:
            raise ValueError(f"decoder {decoder.name} cannot run on {engine}: it reads {CAPABILITIES[need]} ({why}), "
                             "which this engine does not give")


@runtime_checkable
class LoadsAddOns(Protocol):
    """Runs something beside the target (a draft model, heads, an n-gram LM): built by the runner
    before any timing, so that a bad file fails in one line and loading is never timed."""

    def load_addons(self, lm: LM) -> Any: ...


@runtime_checkable
class SelfTuning(Protocol):
    """Tunes itself to this device and model (lookahead's auto W/N/G, Sequoia's acceptance and tree)
    on `calibration_prompts` prompts that the runner takes from past the scored ones."""

    calibration_prompts: int  # 0: nothing left to tune

    def prepare(self, lm: LM, prompts: list[list[int]], stop_ids, sampling: Sampling) -> None: ...


@runtime_checkable
class ReportsTuning(Protocol):
    """`tuning`: what an automatic setting resolved to and what it forecast; records keep it."""

    tuning: dict | None


@runtime_checkable
class Foresees(Protocol):
    """Drafts from the target's own greedy continuation of each prompt (the oracle). The runner calls
    foresee() with a prompt's ids and token budget before that prompt's clock starts, so the pass
    that finds the continuation is in no timed figure; generate() may call it again (a lookup then)."""

    def foresee(self, lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids) -> None: ...


def foresee(decoder: Decoder, lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids) -> None:
    """The untimed per-prompt preparation of a decoder that Foresees; nothing for any other."""
    if isinstance(decoder, Foresees):
        decoder.foresee(lm, prompt_ids, max_new_tokens, stop_ids)


def check_sampling(decoder: Decoder, sampling: Sampling) -> None:
    """A decoder that decodes greedily only (`greedy_only = True`: the oracle drafts the greedy
    continuation) refuses sampling: one ValueError naming gen.temperature and what is allowed."""
    if getattr(decoder, "greedy_only", False) and not sampling.greedy:
        raise ValueError(f"decoder {decoder.name} decodes greedily only: gen.temperature must be 0, "
                         f"got {sampling.temperature}")


@runtime_checkable
class CarriesState(Protocol):
    """Drafts from what earlier prompts left behind (recycling's hot table). `carried(lm)` is that
    state, a dict changed in place; warm-ups and timed repeats put it back as it was (see
    `kept_as_is`), so that no prompt drafts from its own earlier decoding."""

    def carried(self, lm: LM) -> dict: ...


def carried_copy(decoder: Decoder, lm: LM) -> dict | None:
    """A copy of what `decoder` carries between prompts on `lm` (None: nothing)."""
    return copy.deepcopy(decoder.carried(lm)) if isinstance(decoder, CarriesState) else None


def carry(decoder: Decoder, lm: LM, state: dict | None) -> None:
    """Put back a state carried_copy() took (None: nothing to put back)."""
    if state is not None:
        carried = decoder.carried(lm)
        carried.clear()
        carried.update(copy.deepcopy(state))


@contextmanager
def kept_as_is(decoder: Decoder, lm: LM):
    """What `decoder` carries between prompts is the same after the block as before it (warm-ups)."""
    saved = carried_copy(decoder, lm)
    try:
        yield
    finally:
        carry(decoder, lm, saved)


@runtime_checkable
class Batches(Protocol):
    """Decodes with the shared loop, so it can decode B prompts in one batch (gen.batch_size > 1):
    builds one prompt's proposer over `sampler` (the row's own draws) and the acceptance rule
    (None: exact verification). generate() is decode_one(self, ...), but for autoregressive, whose
    single-prompt generate() keeps its own leaner loop (the baseline every ratio uses)."""

    def proposer(self, lm: LM, prompt_ids: Sequence[int], sampler: Sampler,
                 stop_ids) -> tuple[Proposer, Accept | None]: ...


def decode_one(decoder: Batches, lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
               stop_ids) -> Generation:
    """A Batches decoder's generate(): its proposer on one prompt (core/batch.py runs B of them)."""
    sampler = Sampler(sampling, lm.output_device)
    proposer, accept = decoder.proposer(lm, prompt_ids, sampler, stop_ids)
    return speculative_decode(lm, check_proposer(proposer), prompt_ids, max_new_tokens, sampler, stop_ids,
                              accept=accept)


T = TypeVar("T")


class PerTarget(Generic[T]):
    """One add-on (a draft, heads) built per target: decoders are built once and called per
    prompt, so generate() must not rebuild it; a different target builds its own."""

    def __init__(self):
        self._key = None
        self._value: T | None = None

    def get(self, lm: LM, build: Callable[[], T]) -> T:
        if self._key is not lm:
            self._value, self._key = build(), lm
        return self._value


def check(key: str, value: Any, *, at_least: int | None = None, one_of: Sequence = (), also: Sequence = (),
          required: str | None = None) -> None:
    """Raise one ValueError naming decoder.<key> and what is allowed. The value must be an integer
    >= at_least, or one of `one_of`; values in `also` (e.g. "auto", -1) pass as they are;
    `required` words the error for a missing (None) value. Lists: check each item as key[]."""
    if value is None and required is not None:
        raise ValueError(f"decoder.{key} is required: {required}")
    if any(value == a and type(value) is type(a) for a in also):
        return
    if one_of:
        if value not in one_of:
            raise ValueError(f"decoder.{key} must be one of {', '.join(map(str, one_of))}, got {value!r}")
        return
    if at_least is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= at_least):
        extra = "".join(f" or {a}" for a in also)
        raise ValueError(f"decoder.{key} must be an integer >= {at_least}{extra}, got {value!r}")


def check_list(key: str, values: Any, *, at_least: int) -> tuple:
    """A non-empty list of integers >= at_least (auto's candidates), each checked as key[]; as a tuple.
    An empty one left auto nothing to choose from (max() of an empty sequence, naming no key)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"decoder.{key} must be a non-empty list of integers >= {at_least}, got {values!r}")
    for value in values:
        check(f"{key}[]", value, at_least=at_least)
    return tuple(values)


# The most tokens one step may feed the target. Published methods feed tens (EAGLE-2's 60, Medusa's 64,
# lookahead's largest W=15, N=5, G=15: 121); a wider step would not fit a model's context, and its
# masks and logits grow with its square and the vocabulary: decoder.window=1000000 asked for 1 TB.
MAX_STEP_TOKENS = 4096


def check_step(tokens: int, how: str) -> int:
    """One ValueError when the settings make a step feed more than MAX_STEP_TOKENS tokens; `how`
    says which settings, e.g. "window 5 x (ngram 4 - 1) + ...". Checked with the settings, before
    any run directory or model. Returns `tokens`: each decoder keeps it as its `widest_step`."""
    if tokens > MAX_STEP_TOKENS:
        raise ValueError(f"{how} = {tokens} tokens fed to the target in one step; at most "
                         f"{MAX_STEP_TOKENS} are allowed: lower them")
    return tokens


@runtime_checkable
class DeclaresStep(Protocol):
    """The most tokens one step feeds the target (check_step's result, from the settings): the memory
    estimate counts that step's logits and activations. Every decoder that feeds more than one token a
    step declares it; one that does not is taken to feed one (autoregressive, transformers' generate())."""

    widest_step: int


def widest_step(decoder) -> int:
    """The most tokens `decoder` feeds the target in one step. A decoder running the shared loop (Batches)
    must declare it: feeding a tree, it would otherwise be estimated at one token and could fail to fit
    after loading."""
    if isinstance(decoder, DeclaresStep):
        return decoder.widest_step
    if isinstance(decoder, Batches):
        raise TypeError(f"decoder {getattr(decoder, 'name', type(decoder).__name__)} drafts in the shared loop but "
                        "declares no widest_step: set it from its settings with contract.check_step")
    return 1


@runtime_checkable
class WaitsForPrefill(Protocol):
    """A proposer whose drafts come from the target's own pass (a draft model catching up on the prompt,
    heads on the hidden state, EAGLE on its features): at the prefill the loop does not ask it but scores
    the root alone with `hidden` and `feature_layers` (loop.propose), the same it asks for at every step."""

    waits_for_prefill: bool  # True
    hidden: bool  # the last hidden state after the final norm, per tree node (Proposal.hidden)
    feature_layers: bool | tuple[int, ...]  # the features it reads (Proposal.feature_layers); False: none


def check_proposer(proposer: Proposer) -> Proposer:
    """`proposer`, refused in one line where it waits for the prefill without saying what that pass returns."""
    if getattr(proposer, "waits_for_prefill", False) and not isinstance(proposer, WaitsForPrefill):
        raise TypeError(f"{type(proposer).__name__} sets waits_for_prefill but not both hidden and feature_layers "
                        "(False where it reads none): the prefill's pass returns them (contract.WaitsForPrefill)")
    return proposer
