"""Why a decoding step costs what it costs on this device: the target forward timed alone in a tight
loop (median and fastest of N, with and without a tree-style mask) beside the same forward inside
a decode (per-step median), at the torch CPU threads given and with each set of attention kernels
given, and torch.profiler's top operators over one decode. A decode step much slower than the same
forward alone is the harness's (or the machine's) cost, not the model's. Per kernel set also: how
far a k-token masked forward's logits fall from the one-token steps' at the same places (what the
lossless check's tie tolerance must absorb), and each decode judged against autoregressive's.

Every pass and every decoder gets a prompt of a length no earlier one had, and the forward alone is
also timed over a growing context (a new length each call, as in a decode): kernels that plan per
shape (cuDNN's attention builds and caches a plan for each) pay for the plan only on new shapes,
so a repeated shape would hide that cost.

    python scripts/gpu/step_probe.py [--shape vicuna-7b|tiny] [--decoders autoregressive,spec_chain]
        [--threads 0,1] [--kernels all,flash+efficient,efficient] [--tokenizer DIR] [hydra overrides...]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from big_target import COMMON

from bench.metrics import departure_ulps, ulp
from bench.models import borrow_tokenizer
from bench.runner import build, judge_lossless
from bench.shapes import SHAPES, untrained
from bench.usage import Parser, stop_if_parse_only
from decoders.core.kv_cache import causal_mask
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode

REPO = Path(__file__).resolve().parents[2]

# Sets of scaled_dot_product_attention kernels torch may choose from (its math kernel always can);
# the harness's own choice on a GPU is decoders/core/lm.py's use_attention_kernels, set at load.
KERNELS = {"all": ("cudnn", "flash", "mem_efficient"), "flash+efficient": ("flash", "mem_efficient"),
           "efficient": ("mem_efficient",)}


def use_kernels(name: str) -> None:
    for kernel in ("cudnn", "flash", "mem_efficient"):
        getattr(torch.backends.cuda, f"enable_{kernel}_sdp")(kernel in KERNELS[name])


def agreement(lm, context: int, k: int) -> str:
    """How far each row of one k-token causal forward after `context` tokens falls from the
    one-token step at the same place: the largest logit difference and the judge's departure of
    the wide row's argmax, both in ulps of the step's top-1 logit."""
    ids = [100 + (7 * i) % 5000 for i in range(context + k)]
    cache = lm.new_cache()
    lm.forward(ids[:context], cache, last_only=True)
    wide = lm.forward(ids[context:], cache, position_ids=torch.arange(context, context + k),
                      mask=causal_mask(k, context), logits_last=k)
    cache.crop(context)
    diff, departure = 0.0, 0.0
    for i in range(k):
        step = lm.forward(ids[context + i:context + i + 1], cache, last_only=True)[-1]
        unit = ulp(float(step.max()), step.dtype)
        diff = max(diff, float((wide[i].float() - step.float()).abs().max()) / unit)
        departure = max(departure, departure_ulps(step, int(wide[i].argmax())))
    return f"largest logit difference {diff:5.1f} ulps, largest departure of the argmax {departure:4.1f} ulps"


def forward_alone(lm, k: int, context: int, masked: bool, repeats: int, grow: bool = False) -> list[float]:
    """Seconds of each of `repeats` forwards of k tokens after `context` cached ones (grow: after
    context, context + 1, ...: a new shape each time)."""
    ids = list(range(100, 100 + context + repeats + 2 + k))
    cache = lm.new_cache()
    lm.forward(ids[:context], cache, last_only=True)
    times = []
    for i in range(repeats + 2):
        context_now = context + i if grow else context
        if grow and i:  # one more cached token than the last call
            lm.forward(ids[context_now - 1:context_now], cache, last_only=True)
        kwargs = {}
        if masked:
            mask = torch.ones(k, context_now + k, dtype=torch.bool)
            mask[:, context_now:] = torch.tril(mask[:, context_now:])
            kwargs = dict(position_ids=torch.arange(context_now, context_now + k), mask=mask, logits_last=k)
        lm.sync()
        start = time.perf_counter()
        lm.forward(ids[context_now:context_now + k], cache, **kwargs)
        lm.sync()
        times.append(time.perf_counter() - start)
        cache.crop(context_now)
    return times[2:]


def ms(values) -> str:
    return f"median {1e3 * statistics.median(values):6.1f} ms, fastest {1e3 * min(values):6.1f}, n={len(values)}"


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """This script's options and the Hydra overrides after them."""
    parser = Parser(__doc__, prog="python scripts/gpu/step_probe.py", overrides=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vicuna-7b")
    parser.add_argument("--decoders", default="autoregressive,spec_chain")
    parser.add_argument("--threads", default="0", help="torch CPU threads to try; 0 = torch's default")
    parser.add_argument("--kernels", default="all,flash+efficient,efficient",
                        help=f"attention kernel sets, one pass each: {', '.join(KERNELS)}")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokenizer")
    parsed = parser.parse_known_args()
    stop_if_parse_only()
    return parsed


def decoder_configs(args: argparse.Namespace, extra: list[str]) -> dict:
    """Each --decoders entry's run config: tiny-random at --shape, untrained add-ons where it has any."""
    model = ["model=tiny-random", *SHAPES[args.shape], *borrow_tokenizer(args.tokenizer), *extra]
    specs = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for d in args.decoders.split(","):
            specs[d] = compose("config", overrides=[f"decoder={d}", *model, *COMMON, *untrained(d)])
    return specs


def print_forwards_alone(lm, base: int, repeats: int) -> None:
    """The target forward alone (1 token, growing context, masked, k tokens) and a k-token masked
    forward's logits against the one-token steps', after `base` cached tokens."""
    for k, masked, grow in ((1, False, False), (1, False, True), (1, True, True), (5, True, True), (9, True, True)):
        print(f"forward alone, {k} tokens{' masked' if masked else ''} after "
              f"{f'{base}, {base + 1}, ...' if grow else base}: "
              f"{ms(forward_alone(lm, k, base, masked, repeats, grow))}")
    for k in (5, 16):
        print(f"{k}-token forward against one-token steps after {base}: {agreement(lm, base, k)}")


def print_decodes(lm, specs: dict, prompt: list[int], fresh, max_new_tokens: int) -> None:
    """Each decoder's decode step by part, on a prompt of a new length (from `fresh`), judged against
    autoregressive's output."""
    for name, spec in specs.items():
        decoder = build(spec.decoder, "decoder")
        decoder.generate(lm, prompt, 8, Sampling(), lm.stop_ids)  # warm-up
        ids = list(range(1000, 1000 + next(fresh))) + prompt
        gen = decoder.generate(lm, ids, max_new_tokens, Sampling(), lm.stop_ids)
        # judged as the runner's check_lossless judges: against autoregressive greedy, ties told apart
        reference = autoregressive_decode(lm, ids, max_new_tokens, Sampling(), lm.stop_ids).tokens
        verdict = judge_lossless(lm, ids, gen.tokens, reference)
        judged = ("identical" if verdict["lossless"] else "departs at ties only" if verdict["divergence_tie"]
                  else f"REAL DIVERGENCE at {verdict['first_real_divergence']}")
        steps = gen.steps[1:]
        width = statistics.median(s.forward_tokens for s in steps)
        print(f"{name} (prompt {len(ids)}): decode step target "
              f"{ms([s.target_time for s in steps])}; draft {ms([s.draft_time for s in steps])}; "
              f"overhead {ms([s.overhead_time for s in steps])}; forward tokens (median) {width}; {judged}")


def print_top_operators(lm, name: str, spec, prompt: list[int]) -> None:
    """torch.profiler's top operators over one 12-token decode, by self time and by total (device) time."""
    decoder = build(spec.decoder, "decoder")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if lm.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decoder.generate(lm, prompt, 12, Sampling(), lm.stop_ids)
    for key in ("self_cpu_time_total", "self_device_time_total" if lm.device.type == "cuda" else "cpu_time_total"):
        print(f"\n== {name}, 12 tokens, attention kernels: all, top operators by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=50))


def main() -> None:
    args, extra = parse_args()
    specs = decoder_configs(args, extra)
    cfg = next(iter(specs.values()))
    lm = build(cfg.model, "model").load()
    prompt = lm.tokenizer("Write a short story about a lighthouse keeper who finds a message in a bottle.")["input_ids"]
    default_threads = torch.get_num_threads()
    print(f"{lm.name} {lm.dtype} on {lm.device}; prompt {len(prompt)} tokens; default threads {default_threads}")
    fresh = iter(range(0, 10_000, args.max_new_tokens + 16))  # filler lengths: every decode a new shape
    for threads in [int(t) or default_threads for t in args.threads.split(",")]:
        for kernels in args.kernels.split(","):
            torch.set_num_threads(threads)
            use_kernels(kernels)
            print(f"\n== {threads} CPU threads, attention kernels: {kernels}")
            base = 200 + next(fresh)
            print_forwards_alone(lm, base, args.repeats)
            print_decodes(lm, specs, prompt, fresh, args.max_new_tokens)
    torch.set_num_threads(default_threads)
    use_kernels("all")  # torch's default; a fresh prompt length, so new shapes
    prompt = list(range(1000, 1000 + next(fresh))) + prompt
    name, spec = next(iter(specs.items()))
    print_top_operators(lm, name, spec, prompt)


if __name__ == "__main__":
    main()
