"""Where a decoding step's time goes outside the model, per method.

    python scripts/step_overhead.py [--decoders a,b] [--prompts 2] [--max-new-tokens 64] [--out DIR]
        [hydra overrides: model=... dataset=... threads=...]

Each decoder generates on the first --prompts prompts of the dataset (rendered as the benchmark
renders them; a warm-up generation first), greedy (or at --temperature), in one process. The loop's regions
(decoders/core/loop.py) are timed by wrapping, not by editing, the functions that do them:

  target: model        the target's own forward (the HF model's forward)
  target: harness      the rest of the target region: ids, positions and the mask turned into
                       tensors and the model's input format, the logits rows picked
  draft                propose and commit: drafting, n-gram lookups, the proposer's bookkeeping
  overhead: feed       what is fed this step: positions and the tree's mask (loop.feed)
  overhead: verify     the acceptance of the tree against the target's scores (loop.verify)
  overhead: cache      the KV cache cut to the accepted path (KVCache.keep / crop)
  overhead: rest       the rest of the step: the trace, the stop check, list bookkeeping

Prints ms per step by region (medians over the prompts' per-step means) and writes
DIR/step_overhead.csv (with the device, threads and dtype) and DIR/provenance.json. The hf_*
peers run transformers' generate() and are left out.

On CUDA it also counts the host's waits for the device (`syncs_per_step`): one more generation of
the first prompt, timed as a run times it (on one GPU the loop's tracer records events and waits
once, at the end: trace.DeviceTracer) and not by this script's wrappers, under
torch.cuda.set_sync_debug_mode("warn"), which warns at every operation that synchronises (a read of
a device value: .item(), .tolist(), a bool test, nonzero, a copy to pageable host memory);
DIR/syncs.csv names the lines of code that waited and how often per step. The goal is one per step:
the read of what was accepted.
"""
from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from bench import provenance
from bench.__main__ import script_args
from bench.errors import BenchError, fail
from bench.prompts import render, rendering_for
from bench.registry import decoder_configs
from bench.runner import build
from bench.shapes import untrained
from bench.usage import Parser
from decoders.core import loop
from decoders.core.contract import LoadsAddOns, foresee
from decoders.core.kv_cache import KVCache
from decoders.core.sampling import Sampling
from decoders.core.trace import Tracer
from decoders.core.transfer import sync_counter

REPO = Path(__file__).resolve().parent.parent
REGIONS = ["target: model", "target: harness", "draft", "overhead: feed", "overhead: verify", "overhead: cache",
           "overhead: rest"]


class Clock:
    """Seconds per region of the current generation, from the wrappers below."""

    def __init__(self, sync):
        self.sync, self.spent, self.in_target = sync, defaultdict(float), False

    def wrap(self, region: str, fn, only_in_target: bool = False):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if only_in_target and not self.in_target:
                return fn(*args, **kwargs)
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.spent[region] += time.perf_counter() - start
        return timed


def instrument(clock: Clock, lm) -> None:
    loop.feed = clock.wrap("overhead: feed", loop.feed)
    loop.verify = clock.wrap("overhead: verify", loop.verify)
    # the target's cache only: a draft's own cache edits belong to the draft's time
    new_cache = lm.new_cache

    def marked_cache(**kwargs):
        cache = new_cache(**kwargs)
        cache.of_target = True
        return cache
    lm.new_cache = marked_cache
    for method in ("keep", "crop"):
        plain = getattr(KVCache, method)

        def either(self, *args, _plain=plain, _timed=clock.wrap("overhead: cache", plain)):
            return (_timed if getattr(self, "of_target", False) else _plain)(self, *args)
        setattr(KVCache, method, either)
    # the target's own forward, counted only inside the target region (a self-draft shares its layers)
    lm.model.forward = clock.wrap("target: model", lm.model.forward, only_in_target=True)
    target = Tracer.target

    @contextmanager
    def flagged(self):
        with target(self):
            clock.in_target = True
            try:
                yield
            finally:
                clock.in_target = False
    Tracer.target = flagged


def per_step(gen, spent: dict) -> dict:
    steps = gen.steps
    n = len(steps)
    target = sum(s.target_time for s in steps)
    overhead = sum(s.overhead_time for s in steps)
    split = ("overhead: feed", "overhead: verify", "overhead: cache")
    ms = {"target: model": spent["target: model"], "target: harness": target - spent["target: model"],
          "draft": sum(s.draft_time for s in steps), **{k: spent[k] for k in split},
          "overhead: rest": overhead - sum(spent[k] for k in split)}
    return {"steps": n, "tokens_per_step": sum(s.committed for s in steps) / n,
            **{k: 1e3 * v / n for k, v in ms.items()}}


def main() -> None:
    parser = Parser(__doc__, prog="python scripts/step_overhead.py", overrides=True)
    parser.add_argument("--decoders", default="all", help="comma-separated, or all (the hf_* peers left out)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="directory for step_overhead.csv")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (default 0: greedy); above 0 the sampled verification runs")
    parser.add_argument("--untrained", action="store_true",
                        help="random drafts and heads in the published layouts, as the GPU kit's big target has "
                             "(for a model no shipped add-on fits, e.g. tiny-random)")
    args, overrides = script_args(parser)
    every = [d for d in decoder_configs() if not d.startswith("hf_")]
    names = every if args.decoders == "all" else args.decoders.split(",")
    if unknown := [d for d in names if d not in every]:
        parser.error(f"unknown decoders {', '.join(unknown)}; allowed: {', '.join(every)}")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        specs = {d: compose("config", overrides=[f"decoder={d}", *overrides, *(untrained(d) if args.untrained else [])])
                 for d in names}
    cfg = next(iter(specs.values()))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = build(cfg.model, "model").load()
    rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
    prompts = build(cfg.dataset, "dataset").load()[:args.prompts]
    ids = [render(lm.tokenizer, p, 0, [], rendering)[1] for p in prompts]
    info = provenance.collect(lm)  # before instrumenting: the commit, the device's name, threads, dtype
    where = (f"{lm.name} {info['dtype']} on {info['device_name']}, {info['torch_threads']} threads, "
             f"fast path {info['fast_path']}, {len(ids)} prompts x {args.max_new_tokens} tokens")
    print(where)
    sampling = Sampling(temperature=args.temperature)
    clock = Clock(lm.sync)
    # The loop's tracer on the host's clock too while timing: these regions are the host's. The syncs are
    # counted under the decode's own timer, as a run times it (on one GPU, events: trace.DeviceTracer).
    run_timer, lm.timing_event = lm.timing_event, None
    instrument(clock, lm)
    rows, sync_rows = [], []
    untimed = lambda: None  # noqa: E731
    if lm.device.type != "cuda":
        print("syncs per step: not counted (torch.cuda.set_sync_debug_mode needs a CUDA device)")
    for name, spec in specs.items():
        decoder = build(spec.decoder, "decoder")
        if isinstance(decoder, LoadsAddOns):
            try:
                decoder.load_addons(lm)
            except ValueError as e:  # a draft or heads file for another model: one line, as a run says it
                raise BenchError(str(e)) from None
        decoder.generate(lm, ids[0], 8, sampling, lm.stop_ids)  # warm-up
        measured = []
        for prompt in ids:
            foresee(decoder, lm, prompt, args.max_new_tokens, lm.stop_ids)  # untimed, as the runner does
            clock.spent.clear()
            gen = decoder.generate(lm, prompt, args.max_new_tokens, sampling, lm.stop_ids)
            measured.append(per_step(gen, clock.spent))
        row = {"decoder": name, **{k: statistics.median(m[k] for m in measured)
                                   for k in ("steps", "tokens_per_step", *REGIONS)}}
        row["overhead_total"] = sum(row[k] for k in REGIONS if k.startswith("overhead"))
        syncs = ""
        if lm.device.type == "cuda":
            foresee(decoder, lm, ids[0], args.max_new_tokens, lm.stop_ids)
            clock.sync, lm.timing_event = untimed, run_timer  # this script's wrappers' waits are not the run's
            try:
                with sync_counter(REPO) as sites:
                    gen = decoder.generate(lm, ids[0], args.max_new_tokens, sampling, lm.stop_ids)
            finally:
                clock.sync, lm.timing_event = lm.sync, None
            row["syncs_per_step"] = sum(sites.values()) / len(gen.steps)
            sync_rows += [{"decoder": name, "site": site, "per_step": n / len(gen.steps)}
                          for site, n in sites.most_common()]
            syncs = f"  syncs {row['syncs_per_step']:.1f}"
        rows.append(row)
        print(f"{name:15s} " + "  ".join(f"{k} {row[k]:6.2f}" for k in ("target: harness", "overhead_total",
                                                                          *REGIONS[3:])) + " ms/step" + syncs,
              flush=True)
    table = pd.DataFrame(rows)
    print("\n" + table.to_markdown(index=False, floatfmt=".2f"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        table.assign(where=where).to_csv(args.out / "step_overhead.csv", index=False)
        (args.out / "provenance.json").write_text(json.dumps(info, indent=2) + "\n")
        if sync_rows:
            pd.DataFrame(sync_rows).to_csv(args.out / "syncs.csv", index=False)
        print(f"\nwrote {args.out / 'step_overhead.csv'}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        fail(e)
