"""Our autoregressive loop vs transformers' generate(), side by side in one process.

    python scripts/bench_baselines.py [--prompts 4] [--repeats 3] [--max-new-tokens 128] [hydra overrides...]

For every prompt (the first --prompts of HumanEval, MT-Bench turn 1 and GSM8K) both loops
run --repeats times, in alternating order so that neither always runs first. Prints per
dataset the median tokens/s of each, the median and quartiles of the per-run ratio, our
loop's share of step time spent outside the model forward, and whether the outputs match.
The model, datasets, device, dtype and threads come from conf/ (Hydra overrides apply).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import render, rendering_for  # noqa: E402
from decoders.autoregressive import autoregressive_decode  # noqa: E402
from decoders.sampling import Sampling  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"


def timed(fn):
    start = time.perf_counter()
    gen = fn()
    return gen, time.perf_counter() - start


def quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def print_setup(cfg, lm, args) -> None:
    """The conditions every ratio below was measured under."""
    print(f"model {cfg.model.name} | device {lm.device} | dtype {str(lm.dtype).replace('torch.', '')} | "
          f"threads {torch.get_num_threads()} | attention {lm.attn_implementation} | greedy, "
          f"{args.max_new_tokens} new tokens | {args.prompts} prompts x {args.repeats} repeats per dataset", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--datasets", default="humaneval,mt_bench,gsm8k")
    args, overrides = parser.parse_known_args()

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        datasets = {name: compose("config", overrides=[*overrides, f"dataset={name}"]).dataset
                    for name in args.datasets.split(",")}
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model).load()
    rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
    greedy = Sampling()
    print_setup(cfg, lm, args)

    rows = []
    with torch.inference_mode():
        for name, dataset_cfg in datasets.items():
            prompts = instantiate(dataset_cfg, limit=args.prompts).load()
            ours, theirs, ratios, overhead, identical = [], [], [], [], True
            for i, prompt in enumerate(prompts):
                _, ids = render(lm.tokenizer, prompt, 0, [], rendering)
                run_ours = lambda: autoregressive_decode(lm, ids, args.max_new_tokens, greedy, lm.stop_ids)  # noqa: E731
                run_theirs = lambda: lm.hf_generate(ids, args.max_new_tokens, greedy, lm.stop_ids)  # noqa: E731
                if i == 0:  # warm both up
                    run_ours(), run_theirs()
                for rep in range(args.repeats):
                    order = [("ours", run_ours), ("theirs", run_theirs)]
                    if (i + rep) % 2:
                        order.reverse()
                    result = {who: timed(fn) for who, fn in order}
                    (g_ours, t_ours), (g_theirs, t_theirs) = result["ours"], result["theirs"]
                    identical &= g_ours.tokens == g_theirs.tokens
                    ours.append(len(g_ours.tokens) / t_ours)
                    theirs.append(len(g_theirs.tokens) / t_theirs)
                    ratios.append(ours[-1] / theirs[-1])
                    steps = g_ours.steps[1:]  # decode steps; the prefill is one forward with no loop around it
                    overhead.append(sum(s.overhead_time for s in steps) /
                                    sum(s.overhead_time + s.target_time for s in steps))
            lo, hi = quartiles(ratios)
            rows.append({"dataset": name, "runs": len(ratios),
                         "ours_tok_s": statistics.median(ours), "hf_generate_tok_s": statistics.median(theirs),
                         "ratio_median": statistics.median(ratios), "ratio_p25": lo, "ratio_p75": hi,
                         "ours_overhead_frac": statistics.median(overhead), "outputs_identical": identical})
            print(pd.DataFrame(rows[-1:]).to_string(index=False, float_format="%.3f"), flush=True)
    table = pd.DataFrame(rows)
    print("\nratio = our tokens/s / hf_generate tokens/s per run (>1: ours faster); overhead = share of a decode "
          "step outside the model forward\n")
    print(table.to_markdown(index=False, floatfmt=".3f"))


if __name__ == "__main__":
    main()
