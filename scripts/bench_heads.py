"""Medusa and blockwise parallel decoding (with and without n-gram rescoring) against
autoregressive, side by side on the same prompts in one process.

    python scripts/bench_heads.py [--prompts 4] [--repeats 1] [--max-new-tokens 128]
        [--datasets humaneval,mt_bench,gsm8k] [--neural] [hydra overrides: dtype=... threads=...]

Methods (scripts/side_by_side.py runs them in a rotating order per prompt):
- medusa-auto-32 / -64: the tree of 32 / 64 candidates from the heads' measured accuracies,
- medusa-chain: each head's top-1 (a block of 4),
- bpd-p1: plain blockwise parallel decoding (the heads' top-1 block),
- bpd-ngram-p1: the block rescored by the n-gram LM over the heads' top-4 lattice,
- bpd-p4 / bpd-ngram-p4: the 4 best lattice paths, by the heads alone / rescored, verified together,
- with --neural, bpd-neural-p4: rescored by the draft group's small LM.
Block efficiency is tokens per step; the n-gram columns against their plain counterparts at the
same number of paths show what rescoring adds.
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
from decoders.sampling import Sampling  # noqa: E402
from side_by_side import compare, print_dataset, print_table  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"


def method_overrides(neural: bool) -> dict[str, list[str]]:
    methods = {
        "autoregressive": ["decoder=autoregressive"],
        "medusa-auto-32": ["decoder=medusa", "decoder.tree_size=32"],
        "medusa-auto-64": ["decoder=medusa", "decoder.tree_size=64"],
        "medusa-chain": ["decoder=medusa", "decoder.choices=chain"],
        "bpd-p1": ["decoder=bpd"],
        "bpd-ngram-p1": ["decoder=bpd", "decoder.rescore=ngram"],
        "bpd-p4": ["decoder=bpd", "decoder.paths=4"],
        "bpd-ngram-p4": ["decoder=bpd", "decoder.rescore=ngram", "decoder.paths=4"],
    }
    if neural:
        methods["bpd-neural-p4"] = ["decoder=bpd", "decoder.rescore=neural", "decoder.paths=4"]
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--datasets", default="humaneval,mt_bench,gsm8k")
    parser.add_argument("--neural", action="store_true", help="also bpd rescored by the draft group's small LM")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the method labels")
    parser.add_argument("--heads", default=None, help="heads file for every head method (null: untrained heads); "
                                                       "default: conf/decoder's")
    args, overrides = parser.parse_known_args()

    methods = method_overrides(args.neural)
    if args.methods:
        wanted = ["autoregressive", *[m for m in args.methods.split(",") if m != "autoregressive"]]
        unknown = [m for m in wanted if m not in methods]
        if unknown:
            raise SystemExit(f"error: unknown method(s) {unknown}; choose from {', '.join(methods)}")
        methods = {m: methods[m] for m in wanted}
    if args.heads is not None:
        methods = {m: o if m == "autoregressive" else [*o, f"decoder.heads={args.heads}"] for m, o in methods.items()}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        datasets = {name: compose("config", overrides=[*overrides, f"dataset={name}"]).dataset
                    for name in args.datasets.split(",")}
        decoder_cfgs = {label: compose("config", overrides=[*overrides, *extra]).decoder
                        for label, extra in methods.items()}
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model).load()
    rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
    print_setup(cfg, lm, args)
    rows = []
    with torch.inference_mode():
        runs = {label: instantiate(c, _convert_="all") for label, c in decoder_cfgs.items()}
        for dec in runs.values():
            if hasattr(dec, "load_draft"):
                dec.load_draft(lm)  # heads, n-gram LM, neural rescorer: loaded before any timing
        for name, dataset_cfg in datasets.items():
            loaded = instantiate(dataset_cfg, limit=args.prompts).load()
            prompts = [render(lm.tokenizer, p, 0, [], rendering)[1] for p in loaded]
            for row in compare(lm, runs, prompts, args.repeats, args.max_new_tokens, Sampling()):
                rows.append({"dataset": name, **row})
            print_dataset(rows, name)
    print_table(rows)


if __name__ == "__main__":
    main()
