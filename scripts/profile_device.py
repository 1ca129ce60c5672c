"""Measure (or show the cached) forward latency of 1..K tokens on this device and model.

    python scripts/profile_device.py [--max-tokens 64] [--repeats 5] [--refresh] [hydra overrides...]

The profile is what lookahead's `auto` W/N/G (and other hardware-aware choices) divide by:
it is cached under cache_dir/latency/, keyed by device, CPU threads, model, dtype and
attention kernel. Prints the cost of k tokens relative to one autoregressive step and saves
a plot beside the cached JSON.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decoders.profile import forward_latency, profile_key  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    args, overrides = parser.parse_known_args()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model).load()
    profile = forward_latency(lm, cfg.cache_dir, args.max_tokens, args.context, args.repeats, refresh=args.refresh)
    unit = profile["autoregressive_s"]
    print(f"{profile['key']}: one autoregressive step {unit * 1e3:.1f} ms (median of {profile['repeats']}, "
          f"{profile['context']} cached tokens, {profile['torch_threads']} threads)")
    print(" tokens  ms      x autoregressive step")
    for k, seconds in enumerate(profile["latency_s"], start=1):
        print(f"{k:6d}  {seconds * 1e3:6.1f}  {seconds / unit:5.2f}")
    out = Path(cfg.cache_dir).expanduser() / "latency" / f"{profile_key(lm)}.png"
    fig, ax = plt.subplots(figsize=(6, 4))
    ks = range(1, len(profile["latency_s"]) + 1)
    ax.plot(ks, [s / unit for s in profile["latency_s"]], marker=".")
    ax.set(xlabel="tokens in one forward", ylabel="latency / autoregressive step", title=profile["key"])
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"profile: {out.with_suffix('.json')}\nplot: {out}")


if __name__ == "__main__":
    main()
