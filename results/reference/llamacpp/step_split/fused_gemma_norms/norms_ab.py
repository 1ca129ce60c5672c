"""The one-token float32 step on the kernel path with the model's RMSNorms fused (KernelRMSNorm) and with
transformers' own, in one process, rounds interleaved (the order alternating): each round prefills --context
tokens and takes 8 one-token steps, its figure their median; the medians over rounds are printed.

    python results/reference/llamacpp/step_split/fused_gemma_norms/norms_ab.py --rounds 12 --out DIR \
        model=<config> threads=2
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT)]

from bench import provenance  # noqa: E402
from bench.__main__ import script_args  # noqa: E402
from bench.registry import CONF_DIR  # noqa: E402
from bench.runner import build  # noqa: E402
from bench.usage import Parser  # noqa: E402
from decoders.core import kernels  # noqa: E402


def main():
    parser = Parser(__doc__, prog="norms_ab.py", overrides=True)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--out", required=True, type=Path)
    args, overrides = script_args(parser)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = build(cfg.model, "model").load()
    norms = [m for m in lm.model.modules() if isinstance(m, kernels.KernelRMSNorm)]
    fused = {id(m): type(m) for m in norms}
    ids = list(range(1000, 1000 + args.context))
    times, last = {"fused": [], "transformers'": []}, {}
    for r in range(args.rounds):
        for which in (("fused", "transformers'") if r % 2 else ("transformers'", "fused")):
            for m in norms:
                m.__class__ = fused[id(m)] if which == "fused" else fused[id(m)].__bases__[1]
            cache = lm.new_cache()
            lm.forward(ids, cache, last_only=True)
            steps = []
            for i in range(8):
                start = time.perf_counter()
                last[which] = lm.forward([5 + i], cache, last_only=True)
                steps.append(time.perf_counter() - start)
            times[which].append(1e3 * statistics.median(steps))
    for m in norms:
        m.__class__ = fused[id(m)]
    summary = {"model": cfg.model.name, "norm_classes": sorted({c.__bases__[1].__name__ for c in fused.values()}),
               "norms_per_step": len(norms), "context": args.context, "rounds": args.rounds,
               **{f"step_ms_{k}_norms": statistics.median(v) for k, v in times.items()},
               "max_abs_logit_difference": float((last["fused"] - last["transformers'"]).abs().max()),
               "rounds_ms": times}
    print(json.dumps(summary, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "provenance.json").write_text(json.dumps(provenance.collect(lm), indent=2) + "\n")


if __name__ == "__main__":
    main()
