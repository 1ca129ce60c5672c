"""Measure Sequoia's positional acceptance vector p_1..p_K of a target/draft pair.

    python scripts/measure_acceptance.py [--prompts 4] [--max-new-tokens 64] [--K 8] [--out PATH]
        [hydra overrides: model=... draft=self draft.layers=4 draft.adapter=... dataset=...
         gen.temperature=... gen.top_p=... seed=...]

On the first --prompts prompts of the dataset (rendered as the benchmark renders them) the
target generates --max-new-tokens tokens; at every position the draft proposes K children
(greedy: its top K in order; sampling: K draws without replacement, verified by Sequoia's
sequential rejection) and the rank of the accepted one is counted. p_k = share of positions
where the k-th child was accepted. Writes the vector with its provenance as JSON
(decoders.tuning.sequoia_acceptance.save_acceptance; default under results/acceptance/) and prints it with
the cumulative acceptance and the expected tokens per step of Sequoia's optimal trees.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from bench.__main__ import script_args
from bench.prompts import render, rendering_for
from bench.usage import Parser
from decoders.core.sampling import Sampling
from decoders.methods.draft_model import build_draft
from decoders.tuning.sequoia_acceptance import acceptance_counts, save_acceptance
from decoders.tuning.sequoia_tree import cumulative, optimal_tree

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


def main() -> None:
    parser = Parser(__doc__, prog="python scripts/measure_acceptance.py", overrides=True)
    parser.add_argument("--prompts", type=int, default=4, help="first N prompts of the dataset")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--K", type=int, default=8, help="children drafted per node")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: results/acceptance/...)")
    args, overrides = script_args(parser)
    if args.prompts < 1 or args.K < 1 or args.max_new_tokens < 1:
        parser.error(f"--prompts, --K and --max-new-tokens must be >= 1, got {args.prompts}, {args.K}, "
                     f"{args.max_new_tokens}")

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model, compile="none").load()
    draft = build_draft(instantiate(cfg.draft), lm)
    sampling = Sampling(temperature=cfg.gen.temperature, top_p=cfg.gen.top_p, top_k=cfg.gen.top_k, seed=cfg.seed)
    rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
    prompts = instantiate(cfg.dataset, limit=args.prompts).load()
    ids_list = [render(lm.tokenizer, p, 0, [], rendering)[1] for p in prompts]

    start = time.perf_counter()
    counts, positions = acceptance_counts(lm, draft, ids_list, args.K, sampling, args.max_new_tokens)
    elapsed = time.perf_counter() - start
    if not positions:
        sys.exit("measure_acceptance: no position measured (every prompt fills the model's context)")
    acceptance = [c / positions for c in counts]
    mode = "greedy" if sampling.greedy else f"T={sampling.temperature} top_p={sampling.top_p}"
    info = {"model": cfg.model.name, "draft": draft.name, "draft_config": dict(cfg.draft), "dataset": cfg.dataset.name,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "seed": sampling.seed, "prompts": len(ids_list), "max_new_tokens": args.max_new_tokens,
            "positions": positions, "K": args.K, "rendering": rendering, "dtype": str(lm.dtype),
            "device": str(lm.device), "seconds": round(elapsed, 2)}
    temp = f"t{sampling.temperature:g}" + ("" if sampling.top_p == 1 else f"-p{sampling.top_p:g}")
    out = args.out or REPO / "results" / "acceptance" / (
        f"{cfg.model.name}_{draft.name.split('/')[-1]}_{cfg.dataset.name}_{temp}_K{args.K}.json")
    save_acceptance(out, acceptance, info)

    print(f"{cfg.model.name} / draft {draft.name} | {cfg.dataset.name}, {len(ids_list)} prompts x "
          f"{args.max_new_tokens} tokens | {mode} | {positions} positions in {elapsed:.1f} s")
    print(" k   p_k     P(accepted among first k)")
    for k, (p, c) in enumerate(zip(acceptance, cumulative(acceptance)), start=1):
        print(f"{k:2d}  {p:.4f}  {c:.4f}")
    print("Sequoia's optimal tree, expected tokens per step (budget x max depth):")
    for budget in (4, 8, 16, 32, 64):
        row = "  ".join(f"d<={d}: {optimal_tree(acceptance, budget, d).expected_tokens:.3f}" for d in (2, 4, 8))
        print(f"  budget {budget:3d}  {row}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
