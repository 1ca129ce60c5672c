"""One depth of an EAGLE draft's drafting, timed on this device: k rows through the feature draft
after `context` cached positions, then its readout, log-softmax and top-k, as FeatureDraftProposer
does at every depth; k = 1..--max-tokens (eagle_draft.depth_seconds, which EAGLE's tree_size=auto
also weighs). Written where bench.forecast reads a run's draft (PROFILE/draft-<label>/profile.csv:
context, tokens, <fast path>_ms), so a forecast prices the draft in the profiled dtype and kernels
instead of scaling the run's measured draft time by the target's.

    python scripts/profile_draft.py PROFILE --labels eagle,eagle-8,eagle-static [--max-tokens 32]
        [--context 64,256] [--repeats 7] [hydra overrides: dtype=..., threads=..., decoder overrides]

The labels are the leaderboard entries that draft with the decoder given (default decoder=eagle and
its shipped draft): each gets the same curve. The target loads as a run loads it (model.fast_path as
configured: auto takes the cached choice), uncompiled (the draft is never compiled). The draft's
cache is filled from the target's own features of a random prompt, as at a prefill. Each timed call
follows an untimed one-token target forward, as drafting follows verification in a run (timed back to
back, the draft stays in the caches and cost two thirds of its in-run time here); each size's median
over --repeats calls is reported (a run's steps come as they come, not at their fastest).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import provenance  # noqa: E402
from bench.runner import build, load_addons  # noqa: E402
from decoders.methods.eagle_draft import depth_seconds  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="the profile directory (scripts/profile_device.py --out's) to add to")
    parser.add_argument("--labels", default="eagle", help="the entries drafting with this draft, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--context", default="64,256", help="cached positions, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    args, overrides = parser.parse_known_args(argv)
    if args.max_tokens < 1 or args.repeats < 1:
        parser.error("--max-tokens and --repeats must be at least 1")
    try:
        args.contexts = [int(c) for c in args.context.split(",")]
    except ValueError:
        args.contexts = []
    if not args.contexts or min(args.contexts) < 1:
        parser.error(f"--context {args.context}: give cached-position counts >= 1, comma-separated")
    args.labels = [label for label in args.labels.split(",") if label]
    return args, overrides


def main(argv=None) -> None:
    args, overrides = parse_args(argv)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["decoder=eagle", *overrides])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model, compile="none").load()
    decoder = build(cfg.decoder, "decoder")
    load_addons(decoder, lm)
    draft = decoder.load_addons(lm)
    rows = []
    for context in args.contexts:
        curve = depth_seconds(lm, draft, decoder.top_k, context, range(1, args.max_tokens + 1), args.repeats)
        rows += [{"context": context, "tokens": k, f"{lm.fast_path}_ms": 1e3 * s} for k, s in enumerate(curve, 1)]
    table = pd.DataFrame(rows)
    info = provenance.collect(lm)
    info.update(draft=str(decoder.draft_weights), draft_dtype=str(draft.dtype).replace("torch.", ""),
                top_k=decoder.top_k, statistic=f"median of {args.repeats}", script_args=vars(args))
    for label in args.labels:
        out = Path(args.profile) / f"draft-{label}"
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "profile.csv", index=False)
        (out / "provenance.json").write_text(json.dumps(info, indent=2, default=str))
    shown = table[table["tokens"].isin([1, 2, 4, 8, 16, 24, 32])]
    print(f"{lm.name} {info.get('dtype')}, draft {decoder.draft_weights} ({info['draft_dtype']}), "
          f"{torch.get_num_threads()} threads, fast path {lm.fast_path}: one drafting depth, ms "
          f"(median of {args.repeats})")
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"wrote draft-{{{','.join(args.labels)}}}/profile.csv under {args.profile}")


if __name__ == "__main__":
    main()
