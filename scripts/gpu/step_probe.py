"""Why a decoding step costs what it costs on this device: the target forward timed alone in a tight
loop (median and fastest of N, with and without a tree-style mask) beside the same forward inside
a decode (per-step median), at the torch CPU threads given, and torch.profiler's top operators
over one decode. A decode step much slower than the same forward alone is the harness's (or the
machine's) cost, not the model's.

    python scripts/gpu/step_probe.py [--shape vicuna-7b|tiny] [--decoders autoregressive,spec_chain]
        [--threads 0,1] [--tokenizer DIR] [hydra overrides...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

from big_target import COMMON, SHAPES, UNTRAINED  # noqa: E402

from bench.models import borrow_tokenizer  # noqa: E402
from bench.runner import build  # noqa: E402
from decoders.core.sampling import Sampling  # noqa: E402


def forward_alone(lm, k: int, context: int, masked: bool, repeats: int) -> list[float]:
    """Seconds of each of `repeats` forwards of k tokens after `context` cached ones."""
    ids = list(range(100, 100 + context + k))
    cache = lm.new_cache()
    lm.forward(ids[:context], cache, last_only=True)
    times = []
    for _ in range(repeats + 2):
        kwargs = {}
        if masked:
            mask = torch.ones(k, context + k, dtype=torch.bool)
            mask[:, context:] = torch.tril(mask[:, context:])
            kwargs = dict(position_ids=torch.arange(context, context + k), mask=mask, logits_last=k)
        lm.sync()
        start = time.perf_counter()
        lm.forward(ids[context:], cache, **kwargs)
        lm.sync()
        times.append(time.perf_counter() - start)
        cache.crop(context)
    return times[2:]


def ms(values) -> str:
    return f"median {1e3 * statistics.median(values):6.1f} ms, fastest {1e3 * min(values):6.1f}, n={len(values)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vicuna-7b")
    parser.add_argument("--decoders", default="autoregressive,spec_chain")
    parser.add_argument("--threads", default="0,1", help="torch CPU threads to try; 0 = torch's default")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokenizer")
    args, extra = parser.parse_known_args()
    model = ["model=tiny-random", *SHAPES[args.shape], *borrow_tokenizer(args.tokenizer), *extra]
    specs = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for d in args.decoders.split(","):
            specs[d] = compose("config", overrides=[f"decoder={d}", *model, *COMMON, *UNTRAINED.get(d, [])])
    cfg = next(iter(specs.values()))
    lm = build(cfg.model, "model").load()
    prompt = lm.tokenizer("Write a short story about a lighthouse keeper who finds a message in a bottle.")["input_ids"]
    default_threads = torch.get_num_threads()
    print(f"{lm.name} {lm.dtype} on {lm.device}; prompt {len(prompt)} tokens; default threads {default_threads}")
    for threads in [int(t) or default_threads for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        print(f"\n== {threads} CPU threads")
        for k, masked in ((1, False), (1, True), (5, True), (9, True)):
            print(f"forward alone, {k} tokens{' masked' if masked else ''} after 200: "
                  f"{ms(forward_alone(lm, k, 200, masked, args.repeats))}")
        for name, spec in specs.items():
            decoder = build(spec.decoder, "decoder")
            decoder.generate(lm, prompt, 8, Sampling(), lm.stop_ids)  # warm-up
            gen = decoder.generate(lm, prompt, args.max_new_tokens, Sampling(), lm.stop_ids)
            steps = gen.steps[1:]
            width = statistics.median(s.forward_tokens for s in steps)
            print(f"{name}: decode step target {ms([s.target_time for s in steps])}; draft "
                  f"{ms([s.draft_time for s in steps])}; overhead {ms([s.overhead_time for s in steps])}; "
                  f"forward tokens (median) {width}")
    torch.set_num_threads(default_threads)
    name, spec = list(specs.items())[-1]
    decoder = build(spec.decoder, "decoder")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if lm.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decoder.generate(lm, prompt, 12, Sampling(), lm.stop_ids)
    for key in ("self_cpu_time_total", "self_device_time_total" if lm.device.type == "cuda" else "cpu_time_total"):
        print(f"\n== {name}, 12 tokens, top operators by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=50))


if __name__ == "__main__":
    main()
