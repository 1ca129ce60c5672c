"""The kernel path's fused RMSNorm and rotary embeddings against transformers' own, side by side in one
process: the same model on model.fast_path=kernel, its norms and attention modules switched between
their fused and their own classes every round (the order alternating), forwards of 1, 8 and 32 tokens
after 256 cached ones; medians of the rounds. `--only norm` or `--only rotary` switches one of them.

    python results/reference/kernels/split_zen4/bench_fused_ops.py [--rounds 15] [--only norm|rotary]
        [hydra overrides: dtype=bfloat16 ...]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from bench.__main__ import script_args

from decoders.core.kernels import KernelAttention, KernelRMSNorm
from decoders.tuning.profile import primed_cache, timed_forward

CONF = Path(__file__).resolve().parents[4] / "conf"
SIZES = (1, 8, 32)
CONTEXT = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", choices=("norm", "rotary"), help="switch only these (default: both)")
    args, overrides = script_args(parser)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model, fast_path="kernel", compile="none").load()
    kinds = {"norm": KernelRMSNorm, "rotary": KernelAttention}
    modules = [m for m in lm.model.modules()
               if any(isinstance(m, kinds[k]) for k in kinds if args.only in (None, k))]
    if lm.fast_path != "kernel" or not modules:
        sys.exit(f"bench_fused_ops.py: no fused operations here ({lm.fast_path_note or lm.fast_path})")
    fused = {m: type(m) for m in modules}

    def use(on: bool) -> None:
        for m, cls in fused.items():
            m.__class__ = cls if on else cls.__bases__[1]

    seconds = {(on, k): [] for on in (False, True) for k in SIZES}
    with torch.inference_mode():
        ids, cache = primed_cache(lm, CONTEXT, max(SIZES), random.Random(0))
        for r in range(args.rounds + 1):
            for on in ((False, True) if r % 2 else (True, False)):
                use(on)
                for k in SIZES:
                    t = timed_forward(lm, ids, cache, CONTEXT, 0 if k == 1 else k)  # 1: the autoregressive step
                    if r:  # round 0 warms both up
                        seconds[(on, k)].append(t)
    print(f"{lm.name}, {str(lm.dtype).replace('torch.', '')}, {torch.get_num_threads()} threads, "
          f"{len(modules)} modules fused ({args.only or 'norm and rotary'}), {CONTEXT} cached tokens, "
          f"medians of {args.rounds} interleaved rounds")
    for k in SIZES:
        a, b = (statistics.median(seconds[(on, k)]) * 1e3 for on in (False, True))
        print(f"  {k:>2} tokens: transformers' {a:.2f} ms, fused {b:.2f} ms: "
              f"{a - b:+.2f} ms saved ({(a - b) / a:.1%})")


if __name__ == "__main__":
    main()
