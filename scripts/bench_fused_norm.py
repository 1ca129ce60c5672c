"""The kernel path's fused RMSNorm against transformers' own, side by side in one process: the same
model on model.fast_path=kernel, its norms switched between the two classes every round (the order
alternating), forwards of 1, 8 and 32 tokens after 256 cached ones; medians of the rounds.

    python scripts/bench_fused_norm.py [--rounds 15] [hydra overrides: dtype=bfloat16 threads=2 ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decoders.core.kernels import KernelRMSNorm  # noqa: E402
from decoders.core.kv_cache import causal_mask  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"
SIZES = (1, 8, 32)
CONTEXT = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args, overrides = parser.parse_known_args()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model, fast_path="kernel", compile="none").load()
    norms = [m for m in lm.model.modules() if isinstance(m, KernelRMSNorm)]
    if lm.fast_path != "kernel" or not norms:
        sys.exit(f"bench_fused_norm.py: no fused norms here ({lm.fast_path_note or lm.fast_path})")
    fused, own = type(norms[0]), type(norms[0]).__bases__[1]

    def one(k: int, cache) -> float:
        start = time.perf_counter()
        if k == 1:
            lm.forward([200], cache, last_only=True)
        else:
            lm.forward(list(range(200, 200 + k)), cache, position_ids=list(range(CONTEXT, CONTEXT + k)),
                       mask=causal_mask(k, CONTEXT), logits_last=k)
        elapsed = time.perf_counter() - start
        cache.crop(CONTEXT)
        return elapsed

    seconds = {(cls, k): [] for cls in (own, fused) for k in SIZES}
    with torch.inference_mode():
        cache = lm.new_cache()
        lm.forward(list(range(100, 100 + CONTEXT)), cache)
        for r in range(args.rounds + 1):
            for cls in ((own, fused) if r % 2 else (fused, own)):
                for m in norms:
                    m.__class__ = cls
                for k in SIZES:
                    t = one(k, cache)
                    if r:  # round 0 warms both up
                        seconds[(cls, k)].append(t)
    print(f"{lm.name}, {str(lm.dtype).replace('torch.', '')}, {torch.get_num_threads()} threads, "
          f"{len(norms)} norms, {CONTEXT} cached tokens, medians of {args.rounds} interleaved rounds")
    for k in SIZES:
        a, b = (statistics.median(seconds[(cls, k)]) * 1e3 for cls in (own, fused))
        print(f"  {k:>2} tokens: transformers' norm {a:.2f} ms, fused {b:.2f} ms: "
              f"{a - b:+.2f} ms saved ({(a - b) / a:.1%})")


if __name__ == "__main__":
    main()
