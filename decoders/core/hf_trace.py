"""transformers' own generate(), traced: one Step per target forward (forward hooks), the tokens
each step committed (the streamer), so its loops are measured as ours are.

generate()'s config merging lives here and nowhere else.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from .kv_cache import passed_cache
from .lm import forward_flops
from .sampling import Sampling
from .trace import Generation, Step, stop_reason, truncate_at_stop

if TYPE_CHECKING:
    from .lm import LM


@torch.inference_mode()
def hf_generate(lm: LM, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                stop_ids, assistant: "LM | None" = None, **generate_kwargs) -> Generation:
    """Run model.generate() and recover the DESIGN trace: one Step per target forward
    (forward hooks), tokens committed per step (the streamer is called once per step
    with exactly the tokens that step committed). With an assistant (assisted
    generation with the draft LM `assistant`), its forwards are charged to the next target step
    as draft time, tokens and FLOPs; its first pass over the prompt as draft_prefill_flops."""
    hooks = _StepHooks(lm, len(prompt_ids), assistant)
    assistant_model = assistant.model if assistant is not None else None
    _seed_generate(lm, sampling)
    lm.sync()
    start = time.perf_counter()
    streamer = _StepStreamer(hooks.steps)
    config = _generation_config(max_new_tokens, sampling, stop_ids, **generate_kwargs)
    with hooks.attached(lm.model, assistant_model):
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)
        out = lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                generation_config=config, streamer=streamer, assistant_model=assistant_model)
    lm.sync()
    total = time.perf_counter() - start
    tokens = truncate_at_stop(out[0, ids.shape[1]:].tolist(), stop_ids, max_new_tokens)
    steps = hooks.timed_steps()
    _fit_committed(steps, len(tokens))
    _count_drafts(steps, len(prompt_ids))
    # Whatever generate() did outside the forwards is overhead; spread it per step.
    outside = max(0.0, total - sum(s.target_time + s.draft_time for s in steps))
    for s in steps:
        s.overhead_time = outside / len(steps)
    ttft = streamer.first_token_time - start if streamer.first_token_time else total
    return Generation(tokens=tokens, steps=steps, ttft=ttft, stop_reason=stop_reason(tokens, stop_ids))


def _seed_generate(lm: LM, sampling: Sampling) -> None:
    """generate() draws from the device's global RNG: seed it before the clock starts."""
    if sampling.greedy:
        return
    if lm.device.type == "cuda":
        torch.cuda.manual_seed_all(sampling.seed)  # it draws on the head's GPU, which a device_map may make another
    else:
        torch.default_generator.manual_seed(sampling.seed)


@dataclass
class _Drafted:
    """The assistant's forwards since the last target step, charged to the next one."""

    spans: list = field(default_factory=list)  # (start, end) of each forward: _StepHooks.mark()'s
    tokens: int = 0
    flops: float = 0.0
    prefill: float = 0.0  # of flops, its first pass over the prompt


class _StepHooks:
    """Forward hooks on the target (one Step per forward) and on the assistant (its drafting). The
    forwards are timed as our loop's are (trace.new_tracer): on one GPU by events read once generate()
    has finished, so that timing it makes the host wait no more than generate() itself does; else by
    the host's clock, synchronised at each forward's start and end."""

    def __init__(self, lm: LM, prompt_len: int, assistant: "LM | None"):
        self.lm, self.prompt_len = lm, prompt_len
        self.draft_spec = assistant.flops_spec() if assistant is not None else None
        self.steps: list[Step] = []
        self.spans: list[tuple] = []  # per step: the target forward's (start, end), its drafted spans
        self.drafted = _Drafted()
        self._forward: dict = {}  # the target forward under way: its start, tokens fed, cache length
        self._draft_start = None

    def mark(self):
        """Now: a recorded timing event on the device's timeline, or the host's clock after a sync."""
        if self.lm.timing_event is not None:
            return self.lm.timing_event()
        self.lm.sync()  # generate()'s own work before the mark is charged before it
        return time.perf_counter()

    def timed_steps(self) -> list[Step]:
        """The steps with their target and draft seconds (events are read here: after generate())."""
        def seconds(start, end) -> float:
            return end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3
        for step, (target, drafted) in zip(self.steps, self.spans):
            step.target_time = seconds(*target)
            step.draft_time = sum(seconds(*span) for span in drafted)
        return self.steps

    @contextmanager
    def attached(self, model, assistant_model):
        handles = [model.register_forward_pre_hook(self.target_pre, with_kwargs=True),
                   model.register_forward_hook(self.target_post, with_kwargs=True)]
        if assistant_model is not None:
            handles += [assistant_model.register_forward_pre_hook(self.draft_pre, with_kwargs=True),
                        assistant_model.register_forward_hook(self.draft_post, with_kwargs=True)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def target_pre(self, module, args, kwargs):
        ids, context = _fed(args, kwargs)
        self._forward = dict(start=self.mark(), tokens=ids, context=context)

    def target_post(self, module, args, kwargs, output):
        d = self.drafted
        self.spans.append(((self._forward["start"], self.mark()), d.spans))
        self.steps.append(Step(committed=0, forward_tokens=self._forward["tokens"],
                               context_tokens=self._forward["context"], draft_forward_tokens=d.tokens,
                               draft_flops=d.flops, draft_prefill_flops=d.prefill))
        self.drafted = _Drafted()

    def draft_pre(self, module, args, kwargs):
        n, context = _fed(args, kwargs)
        self._draft_start = self.mark()
        self.drafted.tokens += n
        self.drafted.flops += forward_flops(self.draft_spec, n, context)
        if context == 0:  # the assistant's first pass reads the prompt: its prefill
            self.drafted.prefill += forward_flops(self.draft_spec, min(n, self.prompt_len), 0)

    def draft_post(self, module, args, kwargs, output):
        self.drafted.spans.append((self._draft_start, self.mark()))


def _fed(args, kwargs) -> tuple[int, int]:
    """A forward's tokens fed and the length of the cache it was passed."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    cache = passed_cache(kwargs)
    return (int(ids.shape[-1]) if ids is not None else 0), (cache.get_seq_length() if cache is not None else 0)


def _count_drafts(steps: list[Step], prompt_len: int) -> None:
    """Each step's drafted and accepted tokens: what it fed beyond the committed tokens not yet cached."""
    committed = 0
    for s in steps:
        uncached = prompt_len + committed - s.context_tokens
        s.draft_tokens = max(0, s.forward_tokens - uncached)
        s.accepted_draft_tokens = max(0, min(s.committed - 1, s.draft_tokens))
        committed += s.committed


@torch.inference_mode()
def hf_generate_batch(lm: LM, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids) -> list[list[int]]:
    """model.generate() on B prompts at once, greedy, left-padded (what transformers users batch
    with); each row's new tokens, cut at its first stop token. The peer of batched autoregressive."""
    width = max(map(len, prompts))
    pad = min(stop_ids) if stop_ids else 0
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=lm.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                             device=lm.device)
    out = lm.model.generate(input_ids=ids, attention_mask=attention,
                            generation_config=_generation_config(max_new_tokens, Sampling(), stop_ids))
    return [truncate_at_stop(row[width:].tolist(), stop_ids, max_new_tokens) for row in out]


def _generation_config(max_new_tokens, sampling: Sampling, stop_ids, **extra) -> GenerationConfig:
    # Every knob that changes the output is set explicitly: generate() fills unset (None)
    # fields from the checkpoint's generation_config (e.g. llama-2-chat's sampling defaults).
    neutral = dict(
        max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=not sampling.greedy,
        repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1,
        eos_token_id=sorted(stop_ids), pad_token_id=min(stop_ids) if stop_ids else 0, use_cache=True,
    )
    if not sampling.greedy:
        neutral.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                       min_p=None, typical_p=1.0)
    neutral.update(extra)
    return GenerationConfig(**neutral)


class _StepStreamer(BaseStreamer):
    """generate() calls put() once with the prompt, then once per step with its new tokens."""

    def __init__(self, steps: list[Step]):
        self.steps = steps
        self.seen_prompt = False
        self.first_token_time: float | None = None

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.steps[-1].committed += int(value.numel())

    def end(self):
        pass


def _fit_committed(steps: list[Step], n_tokens: int) -> None:
    """After truncation at EOS/max_new_tokens, cap each step's count so they sum to n_tokens."""
    total = 0
    for s in steps:
        s.committed = min(s.committed, n_tokens - total)
        total += s.committed
