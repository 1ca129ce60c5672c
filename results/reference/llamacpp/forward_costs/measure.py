"""What a llama.cpp forward of k tokens costs as the context and the width change: the two things a k-token cost
curve taken at one context and at a few widths leaves out.

    python results/reference/llamacpp/forward_costs/measure.py --contexts 100,200,... --widths 0,8,16 --out DIR ...
    python results/reference/llamacpp/forward_costs/measure.py --contexts 111 --widths 0,1,...,17 --out DIR ...

Per context, the project's profile samples (decoders/tuning/profile.forward_samples: a cache of that many random
tokens, then `--rounds` rounds over the widths in a fresh random order; width 0: the one-token autoregressive step;
forwards as the tree decoders feed them); medians in ms, one line per context, and forward_costs.csv.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT)]

from bench import provenance  # noqa: E402
from bench.__main__ import script_args  # noqa: E402
from bench.registry import CONF_DIR  # noqa: E402
from bench.runner import build  # noqa: E402
from bench.usage import Parser  # noqa: E402
from decoders.tuning.profile import forward_samples  # noqa: E402


def main(argv=None):
    parser = Parser(__doc__, prog="measure.py", overrides=True)
    parser.add_argument("--contexts", required=True)
    parser.add_argument("--widths", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", required=True, type=Path)
    args, overrides = script_args(parser, argv)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "model.backend=llamacpp"])
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    widths = [int(k) for k in args.widths.split(",")]
    lm = build(cfg.model, "model").load(step=max(widths))
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        measured = forward_samples(lm, max(widths), context, args.rounds, sizes=[k for k in widths if k])
        samples = {k: measured[k] for k in widths}
        rows += [{"context": context, "tokens": k, "median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3}
                 for k, v in samples.items()]
        print(f"context {context}: " + "  ".join(f"{k}: {statistics.median(v) * 1e3:.1f}" for k, v in samples.items()),
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "forward_costs.csv", index=False)
    (args.out / "provenance.json").write_text(json.dumps(provenance.collect(lm), indent=2))


if __name__ == "__main__":
    main()
