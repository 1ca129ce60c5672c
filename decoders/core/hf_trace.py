"""transformers' own generate(), traced: one Step per target forward (forward hooks), the tokens
each step committed (the streamer), so its loops are measured as ours are.

generate()'s config merging lives here and nowhere else.
"""
from __future__ import annotations

import time
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
    steps: list[Step] = []
    pending: dict = {}
    drafted = {"time": 0.0, "tokens": 0, "flops": 0.0, "prefill": 0.0}
    assistant_model = assistant.model if assistant is not None else None
    draft_spec = assistant.flops_spec() if assistant is not None else None
    if not sampling.greedy:  # generate() draws from the device's global RNG; seed it before the clock starts
        if lm.device.type == "cuda":
            # it draws on the head's GPU, which a device_map may make another one
            torch.cuda.manual_seed_all(sampling.seed)
        else:
            torch.default_generator.manual_seed(sampling.seed)
    lm.sync()
    start = time.perf_counter()

    def pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = passed_cache(kwargs)
        lm.sync()  # generate()'s own work before this forward is overhead, not target time
        pending.update(t0=time.perf_counter(), tokens=int(ids.shape[-1]),
                       context=cache.get_seq_length() if cache is not None else 0)

    def post_hook(module, args, kwargs, output):
        lm.sync()
        steps.append(Step(committed=0, forward_tokens=pending["tokens"], context_tokens=pending["context"],
                          target_time=time.perf_counter() - pending["t0"], draft_time=drafted["time"],
                          draft_forward_tokens=drafted["tokens"], draft_flops=drafted["flops"],
                          draft_prefill_flops=drafted["prefill"]))
        drafted.update(time=0.0, tokens=0, flops=0.0, prefill=0.0)

    def draft_pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = passed_cache(kwargs)
        lm.sync()
        drafted["t0"] = time.perf_counter()
        n = int(ids.shape[-1]) if ids is not None else 0
        context = cache.get_seq_length() if cache is not None else 0
        drafted["tokens"] += n
        drafted["flops"] += forward_flops(draft_spec, n, context)
        if context == 0:  # the assistant's first pass reads the prompt: its prefill
            drafted["prefill"] += forward_flops(draft_spec, min(n, len(prompt_ids)), 0)

    def draft_post_hook(module, args, kwargs, output):
        lm.sync()
        drafted["time"] += time.perf_counter() - drafted.pop("t0")

    streamer = _StepStreamer(steps)
    config = _generation_config(max_new_tokens, sampling, stop_ids, **generate_kwargs)
    handles = [lm.model.register_forward_pre_hook(pre_hook, with_kwargs=True),
               lm.model.register_forward_hook(post_hook, with_kwargs=True)]
    if assistant_model is not None:
        handles += [assistant_model.register_forward_pre_hook(draft_pre_hook, with_kwargs=True),
                    assistant_model.register_forward_hook(draft_post_hook, with_kwargs=True)]
    try:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)
        out = lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                generation_config=config, streamer=streamer, assistant_model=assistant_model)
    finally:
        for h in handles:
            h.remove()
    lm.sync()
    total = time.perf_counter() - start
    tokens = truncate_at_stop(out[0, ids.shape[1]:].tolist(), stop_ids, max_new_tokens)
    _fit_committed(steps, len(tokens))
    committed = 0
    for s in steps:
        # Tokens fed = committed tokens not yet in the cache + candidates to verify.
        uncached = len(prompt_ids) + committed - s.context_tokens
        s.draft_tokens = max(0, s.forward_tokens - uncached)
        s.accepted_draft_tokens = max(0, min(s.committed - 1, s.draft_tokens))
        committed += s.committed
    # Whatever generate() did outside the forwards is overhead; spread it per step.
    outside = max(0.0, total - sum(s.target_time + s.draft_time for s in steps))
    for s in steps:
        s.overhead_time = outside / len(steps)
    ttft = streamer.first_token_time - start if streamer.first_token_time else total
    return Generation(tokens=tokens, steps=steps, ttft=ttft, stop_reason=stop_reason(tokens, stop_ids))


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
