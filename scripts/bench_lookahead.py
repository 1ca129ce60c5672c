"""Lookahead and Jacobi against autoregressive and transformers' prompt lookup, side by side.

    python scripts/bench_lookahead.py [--prompts 4] [--repeats 2] [--max-new-tokens 128]
        [--lookahead 4,5,5] [--grid 5,15,15 6,15,15 ...] [--jacobi 8] [hydra overrides...]
        [decoder.auto_windows=[...] decoder.auto_ngrams=[...]: the grid lookahead-auto searches]
        [dtype=bfloat16: the model's dtype]

On the same prompts (the first --prompts of HumanEval, MT-Bench turn 1 and GSM8K), in one
process, every method runs --repeats times per prompt in a rotating order. Prints per
dataset and method: tokens/s (total tokens / total time), the median and quartiles of the
per-run tokens/s ratio to autoregressive on the same prompt and repeat, tokens per step,
how many runs' greedy output equals autoregressive's and, where one departs, how close
autoregressive's top two logits were there (in bfloat16, departures sit on logit ties that
every multi-token pass can break differently, transformers' own included). `lookahead-auto` chooses W/N/G for this
device (decoders/lookahead_tuning.py) from calibration prompts that are NOT benchmarked (the
decoder.auto_prompts after the benchmarked ones), and its predicted speedup is printed beside the measured
one. --grid adds lookahead settings (N,W,G) measured for tokens per step.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import render, rendering_for  # noqa: E402
from bench_baselines import print_setup  # noqa: E402
from side_by_side import LEGEND, compare, print_dataset, print_table  # noqa: E402
from decoders.autoregressive import Autoregressive  # noqa: E402
from decoders.hf_peers import HFPromptLookup  # noqa: E402
from decoders.jacobi import Jacobi  # noqa: E402
from decoders.lookahead import Lookahead  # noqa: E402
from decoders.sampling import Sampling  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"


def nwg(text: str) -> tuple[int, int, int]:
    n, w, g = (int(x) for x in text.split(","))
    return n, w, g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--datasets", default="humaneval,mt_bench,gsm8k")
    parser.add_argument("--lookahead", type=nwg, default=(4, 5, 5), help="the default setting N,W,G")
    parser.add_argument("--grid", type=nwg, nargs="*", default=[], help="more lookahead settings N,W,G")
    parser.add_argument("--jacobi", type=int, default=8, help="Jacobi block size")
    args, overrides = parser.parse_known_args()
    # decoder.* overrides (e.g. decoder.auto_windows=[1,2,3]) configure lookahead-auto only.
    tuning = [o for o in overrides if o.startswith("decoder.")]
    overrides = [o for o in overrides if not o.startswith("decoder.")]

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        datasets = {name: compose("config", overrides=[*overrides, f"dataset={name}"]).dataset
                    for name in args.datasets.split(",")}
        auto_cfg = compose("config", overrides=[*overrides, *tuning, "decoder=lookahead", "decoder.window=auto",
                                                "decoder.ngram=auto", "decoder.guess_set_size=auto"]).decoder
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model).load()
    rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
    greedy = Sampling()
    methods = {"autoregressive": Autoregressive(), "hf_pld": HFPromptLookup(),
               f"jacobi-{args.jacobi}": Jacobi(block_size=args.jacobi)}
    for n, w, g in [args.lookahead, *args.grid]:
        methods[f"lookahead-{n},{w},{g}"] = Lookahead(window=w, ngram=n, guess_set_size=g)
    print_setup(cfg, lm, args)

    rows = []
    with torch.inference_mode():
        for name, dataset_cfg in datasets.items():
            auto = instantiate(auto_cfg, _convert_="all")
            loaded = instantiate(dataset_cfg, limit=args.prompts + auto.auto_prompts).load()
            ids_list = [render(lm.tokenizer, p, 0, [], rendering)[1] for p in loaded]
            prompts, calibration = ids_list[:args.prompts], ids_list[args.prompts:]
            auto.prepare(lm, calibration or prompts[:1], lm.stop_ids)
            tuned = auto.tuning
            label = f"lookahead-auto({tuned['ngram']},{tuned['window']},{tuned['guess_set_size']})"
            runs = {**methods, label: auto}
            for row in compare(lm, runs, prompts, args.repeats, args.max_new_tokens, greedy):
                row.pop("acceptance")  # lookahead's "drafts" are its n-gram candidates: tok_per_step says more
                rows.append({"dataset": name, **row,
                             "predicted_speedup": tuned["predicted_speedup"] if row["method"] == label else float("nan")})
            print_dataset(rows, name)
    print_table(rows, f"{LEGEND}; lookahead settings are N,W,G")


if __name__ == "__main__":
    main()
