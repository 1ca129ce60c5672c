"""What an EAGLE draft's drafting costs on this device, per leaderboard entry: one depth (k rows
through the feature draft after `context` cached positions, then its readout, log-softmax and top-k,
as FeatureDraftProposer does at every depth; k = 1..--max-tokens: eagle_draft.depth_timer, whose
depth_seconds EAGLE's tree_size=auto also weighs) and a whole step. Written where bench.forecast
reads a run's draft (PROFILE/draft-<label>/), so a forecast prices the draft in the profiled dtype
and kernels instead of scaling the run's measured draft time by the target's:
- profile.csv (context, tokens, <fast path>_ms): a step's first depth, each timed call after an
  untimed one-token target forward, as drafting follows verification in a run (the target's
  weights take the draft out of the caches);
- profile_later.csv: every later depth, each timed call after an untimed depth of as many rows, as
  a depth follows the one before;
- step.csv: a whole drafting step of the entry's own tree (FeatureDraftProposer.propose, as the
  run's loop times it) after each context, COMMITTED rows committed first; host_ms_per_depth is what
  it cost beyond its own depths' curves (the tree built between and after them), per depth.
At each context, --repeats rounds (after a warm-up one) each time every size's first and later
depth, in a new random order, and then a whole step; each figure is the median over the rounds (a
run's steps come as they come, not at their fastest), and the host work is the median of each
round's step less that round's own depths, so that a drift of the host between rounds cancels.
results/reference/forecast/draft_pricing/ checks these prices against runs' measured draft time.

    python scripts/profile_draft.py PROFILE --labels eagle,eagle-static [--max-tokens 32]
        [--context 64,256] [--repeats 7] [hydra overrides: +preset=leaders, dtype=..., threads=..., decoder.*=...]

Each label is a leaderboard entry that drafts with an EAGLE draft, composed as the leaderboard
composes it (its tree, size, depth and draft; +preset=leaders adds eagle-8 and eagle-auto), then the
decoder.* overrides given. The target loads as a run loads it (model.fast_path as configured: auto
takes the cached choice), uncompiled (the draft is never compiled). The draft's cache is filled from
the target's own features of a random prompt, as at a prefill.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from bench import provenance
from bench.__main__ import script_args
from bench.__main__ import CONF_DIR, error_reason
from bench.errors import BenchError, fail
from bench.leaderboard import compose_all
from bench.runner import build, load_addons
from bench.usage import Parser
from decoders.methods.eagle_draft import depth_timer

CURVES = {"profile.csv": "target", "profile_later.csv": "draft"}  # file -> what precedes each timed depth
COMMITTED = 2  # rows a timed whole step feeds its first depth: about what a step commits


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = Parser(__doc__, prog="python scripts/profile_draft.py", overrides=True)
    parser.add_argument("profile", help="the profile directory (scripts/profile_device.py --out's) to add to")
    parser.add_argument("--labels", default="eagle", help="leaderboard entries drafting with an EAGLE draft, "
                        "comma-separated")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--context", default="64,256", help="cached positions, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    args, overrides = script_args(parser, argv, config=None)  # leaderboard overrides: compose_all checks them
    if args.max_tokens < 1 or args.repeats < 1:
        parser.error("--max-tokens and --repeats must be at least 1")
    try:
        args.contexts = [int(c) for c in args.context.split(",")]
    except ValueError:
        args.contexts = []
    if not args.contexts or min(args.contexts) < 1:
        parser.error(f"--context {args.context}: give cached-position counts >= 1, comma-separated")
    args.labels = list(dict.fromkeys(label for label in args.labels.split(",") if label))
    if not args.labels:
        parser.error("--labels: give leaderboard entries that draft with EAGLE's draft, comma-separated")
    return args, overrides


def step_timer(lm, decoder, draft, context: int) -> Callable[[], tuple[float, list[int]]]:
    """time_step(): seconds of one whole drafting step of the configured EAGLE decoder (its tree,
    size, depth and top_k), as a run's loop times it (FeatureDraftProposer.propose: every depth, and
    the tree built between and after them), and the rows each of its depths fed. After `context`
    positions drafted from, COMMITTED newly committed rows are fed first; each timed call follows an
    untimed target forward of those rows (verification)."""
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, lm.vocab_size, (context + COMMITTED + 1,), generator=gen).tolist()
    proposer = decoder.proposer(lm, seq[:context + 1], None, [])[0]
    cache = lm.new_cache()
    room = 1 << 10  # new tokens still allowed: never what limits the tree here
    with torch.inference_mode():
        _, feats = lm.forward(seq[:context], cache, features=draft.reads)
        proposer.pending = (feats, seq[1:context + 1])
        proposer.propose(seq[:context + 1], room)  # the draft's cache now holds the context, as after a prefill

    @torch.inference_mode()
    def time_step() -> tuple[float, list[int]]:
        _, feats = lm.forward(seq[context:context + COMMITTED], cache, features=draft.reads)  # (COMMITTED, d)
        proposer.pending = (feats, seq[context + 1:])
        lm.sync()
        start = time.perf_counter()
        proposer.propose(seq, room)
        lm.sync()
        seconds = time.perf_counter() - start
        cache.crop(context)
        proposer.cache.crop(context)
        return seconds, [COMMITTED] + [len(nodes) for nodes, _ in proposer.fed[1:]]

    return time_step


def profile_entry(lm, decoder, draft, args) -> dict[str, pd.DataFrame]:
    """CURVES' tables and step.csv for one entry. At each --context, --repeats rounds after a warm-up
    one, each timing every size's first and later depth (the sizes in a new random order each round)
    and then a whole step, so that the host's drift between rounds touches every figure alike; the
    step's host work is the median over rounds of the step less that round's own depths."""
    column = f"{lm.fast_path}_ms"
    sizes = list(range(1, args.max_tokens + 1))
    rows = {name: [] for name in CURVES}
    steps = []
    for context in args.contexts:
        time_depth = depth_timer(lm, draft, decoder.top_k, context)
        time_step = step_timer(lm, decoder, draft, context)
        order = random.Random(context)
        samples = {(name, k): [] for name in CURVES for k in sizes}
        step_s, host_s = [], []
        for r in range(args.repeats + 1):  # the first a warm-up
            got = {}
            for k in order.sample(sizes, len(sizes)):
                for name, after in CURVES.items():
                    got[name, k] = time_depth(k, after)
            seconds, fed = time_step()
            if r:
                for key, value in got.items():
                    samples[key].append(value)
                depths = got["profile.csv", min(fed[0], args.max_tokens)] + sum(
                    got["profile_later.csv", min(f, args.max_tokens)] for f in fed[1:])
                step_s.append(seconds)
                host_s.append((seconds - depths) / len(fed))
        for name in CURVES:
            rows[name] += [{"context": context, "tokens": k, column: 1e3 * statistics.median(samples[name, k])}
                           for k in sizes]
        steps.append({"context": context, "committed": COMMITTED, "depths": len(fed), "rows": sum(fed),
                      "step_ms": 1e3 * statistics.median(step_s),
                      "host_ms_per_depth": 1e3 * statistics.median(host_s)})
    return {**{name: pd.DataFrame(r) for name, r in rows.items()}, "step.csv": pd.DataFrame(steps)}


def entry_decoders(labels: list[str], overrides: list[str]) -> dict[str, object]:
    """Each label's run config: the leaderboard entry of that name (conf/leaderboard.yaml's decoders,
    with a preset's where one is given) composed as the leaderboard composes it, then the decoder.*
    overrides given (a leaderboard takes none: its entries name theirs)."""
    own = [o for o in overrides if o.lstrip("+~").startswith("decoder.")]
    rest = [o for o in overrides if o not in own]
    only = dict.fromkeys(["autoregressive", *labels])  # the leaderboard composes none without its reference
    base, _, _ = compose_all([*rest, f"leaderboard.only=[{','.join(only)}]"])
    found = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for label in labels:
            try:
                found[label] = cfg = compose("leaderboard", overrides=[*rest, *base.leaderboard.decoders[label], *own])
            except Exception as e:  # Hydra's own errors: one line naming the entry
                raise BenchError(f"--labels {label} with {' '.join(own)}: {error_reason(e)}") from None
            if cfg.decoder.name != "eagle":
                raise BenchError(f"--labels {label} is the leaderboard entry of decoder={cfg.decoder.name}; give "
                                 "entries that draft with EAGLE's draft (eagle, eagle-static; +preset=leaders adds "
                                 "eagle-8, eagle-auto)")
    return found


def main(argv=None) -> None:
    args, overrides = parse_args(argv)
    try:
        configs = entry_decoders(args.labels, overrides)
    except BenchError as e:
        fail(e)
    cfg = next(iter(configs.values()))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model, compile="none").load()
    for label, cfg in configs.items():
        decoder = build(cfg.decoder, "decoder")
        load_addons(decoder, lm)
        draft = decoder.load_addons(lm)
        tables = profile_entry(lm, decoder, draft, args)
        info = provenance.collect(lm)
        info.update(draft=str(decoder.draft_weights), draft_dtype=str(draft.dtype).replace("torch.", ""),
                    top_k=decoder.top_k, tree=decoder.tree, tree_size=decoder.tree_size, depth=decoder.depth,
                    committed=COMMITTED, statistic=f"median of {args.repeats} interleaved rounds",
                    script_args=vars(args))
        out = Path(args.profile) / f"draft-{label}"
        out.mkdir(parents=True, exist_ok=True)
        for name, table in tables.items():
            table.to_csv(out / name, index=False)
        (out / "provenance.json").write_text(json.dumps(info, indent=2, default=str))
        column = f"{lm.fast_path}_ms"
        first, later = tables["profile.csv"], tables["profile_later.csv"]
        shown = first[first["tokens"].isin([1, 2, 4, 8, 16, 24, 32])].rename(columns={column: "first_ms"})
        shown["later_ms"] = later.loc[shown.index, column]
        print(f"{label}: {lm.name} {info.get('dtype')}, draft {decoder.draft_weights} ({info['draft_dtype']}), "
              f"{torch.get_num_threads()} threads, fast path {lm.fast_path}: one drafting depth, ms "
              f"(median of {args.repeats} rounds; first: after the target's forward, later: after another depth)")
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        print(f"a whole drafting step ({decoder.tree} tree, size {decoder.tree_size}, depth {decoder.depth}, "
              f"{COMMITTED} rows committed first), ms (median of the same rounds):")
        print(tables["step.csv"].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        print(f"wrote {', '.join(tables)} under {out}")


if __name__ == "__main__":
    main()
