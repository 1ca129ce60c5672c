"""One depth of an EAGLE draft's drafting, timed on this device: k rows through the feature draft
after `context` cached positions, then its readout, log-softmax and top-k, as FeatureDraftProposer
does at every depth; k = 1..--max-tokens (eagle_draft.depth_seconds, which EAGLE's tree_size=auto
also weighs). Written where bench.forecast reads a run's draft (PROFILE/draft-<label>/: context,
tokens, <fast path>_ms), so a forecast prices the draft in the profiled dtype and kernels instead of
scaling the run's measured draft time by the target's. Two curves, because a step's depths do not
cost the same:
- profile.csv: a step's first depth, each timed call after an untimed one-token target forward, as
  drafting follows verification in a run (the target's weights take the draft out of the caches);
- profile_later.csv: every later depth, each timed call after an untimed depth of as many rows, as
  a depth follows the one before (a static tree's depths run back to back; on a Zen 4 in fp32 a
  later depth took 0.6-0.75 of a first one).
Each size's median over --repeats calls is reported (a run's steps come as they come, not at their
fastest).

    python scripts/profile_draft.py PROFILE --labels eagle,eagle-8,eagle-static [--max-tokens 32]
        [--context 64,256] [--repeats 7] [hydra overrides: dtype=..., threads=..., decoder overrides]

The labels are the leaderboard entries that draft with the decoder given (default decoder=eagle and
its shipped draft): each gets the same curves. The target loads as a run loads it (model.fast_path as
configured: auto takes the cached choice), uncompiled (the draft is never compiled). The draft's
cache is filled from the target's own features of a random prompt, as at a prefill.
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
CURVES = {"profile.csv": "target", "profile_later.csv": "draft"}  # file -> what precedes each timed depth


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
    rows = {name: [] for name in CURVES}
    for context in args.contexts:
        for name, after in CURVES.items():  # both curves at each context in turn: a drift of the host touches both
            curve = depth_seconds(lm, draft, decoder.top_k, context, range(1, args.max_tokens + 1), args.repeats,
                                  after=after)
            rows[name] += [{"context": context, "tokens": k, f"{lm.fast_path}_ms": 1e3 * s}
                           for k, s in enumerate(curve, 1)]
    tables = {name: pd.DataFrame(r) for name, r in rows.items()}
    info = provenance.collect(lm)
    info.update(draft=str(decoder.draft_weights), draft_dtype=str(draft.dtype).replace("torch.", ""),
                top_k=decoder.top_k, statistic=f"median of {args.repeats}", script_args=vars(args))
    for label in args.labels:
        out = Path(args.profile) / f"draft-{label}"
        out.mkdir(parents=True, exist_ok=True)
        for name, table in tables.items():
            table.to_csv(out / name, index=False)
        (out / "provenance.json").write_text(json.dumps(info, indent=2, default=str))
    column = f"{lm.fast_path}_ms"
    first, later = tables["profile.csv"], tables["profile_later.csv"]
    shown = first[first["tokens"].isin([1, 2, 4, 8, 16, 24, 32])].rename(columns={column: "first_ms"})
    shown["later_ms"] = later.loc[shown.index, column]
    print(f"{lm.name} {info.get('dtype')}, draft {decoder.draft_weights} ({info['draft_dtype']}), "
          f"{torch.get_num_threads()} threads, fast path {lm.fast_path}: one drafting depth, ms "
          f"(median of {args.repeats}; first: after the target's forward, later: after another depth)")
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"wrote draft-{{{','.join(args.labels)}}}/{{{','.join(tables)}}} under {args.profile}")


if __name__ == "__main__":
    main()
