"""Draft-model speculative decoders against autoregressive and transformers' assisted
generation, side by side, with the same draft.

    python scripts/bench_speculative.py [--prompts 4] [--repeats 1] [--max-new-tokens 128]
        [--budget 8] [--datasets humaneval,mt_bench,gsm8k] [hydra overrides: draft=self draft.layers=4 ...]

On the same prompts (the first --prompts of each dataset, turn 1), in one process, every
method runs --repeats times per prompt in a rotating order (scripts/side_by_side.py). The
tree methods get the same draft-node budget: spec_chain drafts `budget` tokens, specinfer
2 sequences of budget/2, sequoia its DP-optimal tree of `budget` nodes; `sequoia-auto`
chooses budget and depth for this device from calibration prompts that are NOT benchmarked
(the prompts after the benchmarked ones) and prints its predicted speedup beside the measured one.
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


def method_overrides(budget: int) -> dict[str, list[str]]:
    """label -> decoder overrides; every tree method gets `budget` draft nodes."""
    return {
        "autoregressive": ["decoder=autoregressive"],
        "hf_assisted": ["decoder=hf_assisted"],
        f"spec_chain-{budget}": ["decoder=spec_chain", f"decoder.depth={budget}"],
        f"specinfer-2x{budget // 2}": ["decoder=specinfer", "decoder.num_drafts=2", f"decoder.depth={max(1, budget // 2)}"],
        f"sequoia-{budget}": ["decoder=sequoia", f"decoder.budget={budget}", f"decoder.depth={budget}"],
        "sequoia-auto": ["decoder=sequoia", "decoder.tree=auto"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=8, help="draft nodes per step of the fixed-size methods")
    parser.add_argument("--datasets", default="humaneval,mt_bench,gsm8k")
    args, overrides = parser.parse_known_args()

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        datasets = {name: compose("config", overrides=[*overrides, f"dataset={name}"]).dataset
                    for name in args.datasets.split(",")}
        decoder_cfgs = {label: compose("config", overrides=[*overrides, *extra]).decoder
                        for label, extra in method_overrides(args.budget).items()}
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model).load()
    rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
    greedy = Sampling()
    print_setup(cfg, lm, args)
    print(f"draft: {cfg.draft}", flush=True)

    rows = []
    with torch.inference_mode():
        for name, dataset_cfg in datasets.items():
            runs = {label: instantiate(c, _convert_="all") for label, c in decoder_cfgs.items()}
            wanted = max(getattr(d, "calibration_prompts", 0) for d in runs.values())
            loaded = instantiate(dataset_cfg, limit=args.prompts + wanted).load()
            ids_list = [render(lm.tokenizer, p, 0, [], rendering)[1] for p in loaded]
            prompts, calibration = ids_list[:args.prompts], ids_list[args.prompts:]
            predicted = {}
            for label, dec in runs.items():
                if hasattr(dec, "load_draft"):
                    dec.load_draft(lm)  # built (and shared weights wired) before any timing
                if getattr(dec, "calibration_prompts", 0):
                    dec.prepare(lm, calibration or prompts[:1], lm.stop_ids)
                    tuned = dec.tuning
                    predicted[label] = tuned["predicted_speedup"]
                    print(f"{name}: {label} chose {tuned}", flush=True)
            for row in compare(lm, runs, prompts, args.repeats, args.max_new_tokens, greedy):
                rows.append({"dataset": name, **row, "predicted_speedup": predicted.get(row["method"], float("nan"))})
            print_dataset(rows, name)
    print_table(rows)


if __name__ == "__main__":
    main()
