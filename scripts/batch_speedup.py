"""Speedup against batch size: each method batched over B prompts vs batched autoregressive at the same B.

    python scripts/batch_speedup.py [--prompts 16] [--max-new-tokens 64] [--batch-sizes 1 2 4 8 16]
        [--decoders autoregressive spec_chain medusa lookahead eagle] [--repeats 1] [--out DIR]
        [hydra overrides: model=... dataset=... threads=...]
    python scripts/batch_speedup.py --replot DIR      (DIR/batch_speedup.png again from its CSVs)

For every batch size B the first --prompts prompts of the dataset are decoded in consecutive
batches of B (dataset order), by every decoder in turn, side by side in one process, greedy:
throughput is new tokens / summed batch wall time, and speedup that over batched autoregressive's
at the same B. transformers' generate() (left-padded, greedy) runs on the same batches as the peer
of batched autoregressive. Every row's tokens are compared with its batch-1 autoregressive output.
The cost curve times one batched forward of B rows x q tokens after a 256-token context, relative
to B rows x 1 token: the price of verifying q tokens per row; predicted_speedup is what that
curve, each method's tokens per step, tokens fed per row and drafting time say the speedup should
be (dashed in the plot). Writes batch_speedup.csv, runs.csv, cost_curve.csv, batch_speedup.png/.md
and provenance.json to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from tqdm.auto import tqdm

from bench import provenance
from bench.__main__ import script_args
from bench.plotting import entry_styles, interval, legend_beside, pyplot, save, setup, setup_of, title
from bench.prompts import render, rendering_for
from bench.usage import Parser
from decoders.core.batch import decode_batch
from decoders.core.contract import LoadsAddOns
from decoders.core.hf_trace import hf_generate_batch
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"


def cost_curve(lm, batch_sizes, widths, context: int = 256, repeats: int = 5) -> pd.DataFrame:
    """Median seconds of one batched forward of B rows x q new tokens after `context` cached ones."""
    rows = []
    for b in batch_sizes:
        cache = lm.new_batch_cache(b)
        lm.forward_batch([[7] * context] * b, cache, [range(context)] * b, [None] * b, [[context - 1]] * b)
        for q in widths:
            times = []
            for _ in range(repeats + 1):  # the first is untimed: a new shape's first call
                lm.sync()  # CUDA runs asynchronously: time from an idle device to a finished forward
                t0 = time.perf_counter()
                lm.forward_batch([[7] * q] * b, cache, [range(context, context + q)] * b, [None] * b,
                                 [list(range(q))] * b)
                lm.sync()
                times.append(time.perf_counter() - t0)
                cache.keep_tail(context, [[]] * b)  # back to the context
            rows.append({"batch_size": b, "tokens_per_row": q, "seconds": statistics.median(times[1:])})
    df = pd.DataFrame(rows)
    one = df[df.tokens_per_row == 1].set_index("batch_size").seconds
    df["cost_vs_one_token"] = df.seconds / df.batch_size.map(one)
    return df


def predicted_speedup(table: pd.DataFrame, curve: pd.DataFrame) -> pd.Series:
    """What the cost curve says each speedup should be: a row gains tokens_per_step_per_row tokens
    per step, and the step costs one batched forward of B rows x the mean tokens fed per row
    (interpolated in the curve, extended along its last segment) plus every row's drafting,
    against autoregressive's B rows x 1 token. Padding and loop overhead are left out."""
    out = []
    for _, row in table.iterrows():
        part = curve[curve.batch_size == row.batch_size].sort_values("tokens_per_row")
        q, s = part.tokens_per_row.to_numpy(float), part.seconds.to_numpy()
        w = row.tokens_fed_per_row_step
        if pd.isna(w) or row.decoder == "autoregressive":
            out.append(1.0 if row.decoder == "autoregressive" else float("nan"))
            continue
        cost = np.interp(w, q, s) if w <= q[-1] else s[-1] + (w - q[-1]) * (s[-1] - s[-2]) / (q[-1] - q[-2])
        out.append(row.tokens_per_step_per_row * s[0] / (cost + row.batch_size * row.draft_s_per_row_step))
    return pd.Series(out, index=table.index)


def plot(table: pd.DataFrame, curve: pd.DataFrame, path: Path, where: str) -> Path:
    """Speedup against batch size with its range over the repeats (and the cost curve's prediction), and the cost
    of a batched forward; `where`: the model, dataset, device and dtype."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(12, 4.4), layout="constrained")
    decoders = [d for d in dict.fromkeys(table.decoder) if d != "autoregressive"]
    styles = entry_styles(decoders)
    for name, part in table[table.decoder != "autoregressive"].groupby("decoder", sort=False):
        errors = (interval(part.speedup, part.speedup_min, part.speedup_max)
                  if {"speedup_min", "speedup_max"} <= set(part) else None)
        left.errorbar(part.batch_size, part.speedup, yerr=errors, label=name, capsize=2, elinewidth=0.8,
                      **styles[name])
        if "predicted_speedup" in part and part.predicted_speedup.notna().any():  # older tables have none
            left.plot(part.batch_size, part.predicted_speedup, ls="--", lw=1, color=styles[name]["color"])
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    left.set(xscale="log", xlabel="batch size (prompts decoded together)",
             ylabel="speedup over batched autoregressive (x)")
    title(left, "Speedup (bars: range over repeats; dashed: predicted)", where)
    left.set_xticks(sorted(table.batch_size.unique()), labels=[str(b) for b in sorted(table.batch_size.unique())])
    legend_beside(left)
    batch_styles = entry_styles(sorted(curve.batch_size.unique()))
    for b, part in curve.groupby("batch_size"):
        right.plot(part.tokens_per_row, part.cost_vs_one_token, ms=4, label=f"B={b}", **batch_styles[b])
    right.set(xscale="log", xlabel="tokens per row, q (tokens)", ylabel="forward time / (B rows x 1 token) (x)")
    title(right, "Cost of a batched forward", where)
    right.set_xticks(sorted(curve.tokens_per_row.unique()),
                     labels=[str(q) for q in sorted(curve.tokens_per_row.unique())])
    legend_beside(right)
    return save(fig, path, dpi=120)


def replot(folder: Path) -> Path:
    """batch_speedup.png drawn again from the batch_speedup.csv, cost_curve.csv and provenance.json beside it."""
    info = json.loads((folder / "provenance.json").read_text())
    model = info.get("model") or "smollm2-135m"  # the config's default: older runs did not record it
    where = f"{info.get('dataset', '')}: {setup(info, model)}"
    return plot(pd.read_csv(folder / "batch_speedup.csv"), pd.read_csv(folder / "cost_curve.csv"),
                folder / "batch_speedup.png", where)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """This script's options, checked, and the Hydra overrides after them."""
    parser = Parser(__doc__, prog="python scripts/batch_speedup.py", overrides=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--decoders", nargs="+",
                        default=["autoregressive", "spec_chain", "medusa", "lookahead", "eagle"])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        help="cost curve: tokens per row")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes over the prompts (interleaved)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "batching")
    parser.add_argument("--replot", metavar="DIR", help="only draw DIR/batch_speedup.png again from the CSVs and "
                        "provenance.json an --out run wrote there (alone: nothing is measured)")
    args, overrides = script_args(parser)
    if min(args.batch_sizes + [args.prompts, args.max_new_tokens, args.repeats]) < 1:
        parser.error("--prompts, --max-new-tokens, --repeats and every batch size must be >= 1")
    if "autoregressive" not in args.decoders:
        parser.error("--decoders must include autoregressive: every speedup is against it")
    return args, overrides


def run_config(overrides: list[str], names: list[str]):
    """(config, decoders): the run's config and each named decoder built from it (add-ons not loaded yet)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        decoders = {}
        for name in names:
            dcfg = compose("config", overrides=[*overrides, f"decoder={name}"])
            decoders[name] = instantiate(dcfg.decoder, _convert_="all")
    return cfg, decoders


def loaded_target(cfg, decoders: dict):
    """The target, on the config's threads, with every decoder's add-ons loaded for it."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model).load()
    for decoder in decoders.values():
        if isinstance(decoder, LoadsAddOns):
            decoder.load_addons(lm)
    return lm


def dataset_prompts(lm, cfg, limit: int) -> list[list[int]]:
    """The dataset's first `limit` prompts, rendered as a benchmark run renders a first turn."""
    rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
    return [render(lm.tokenizer, p, 0, [], rendering)[1] for p in instantiate(cfg.dataset, limit=limit).load()]


GREEDY = Sampling()


@dataclass
class Bench:
    """What every batched run shares: the target, the decoders by name, the prompts and their batch-1
    autoregressive outputs (filled in by batch1_reference), the token budget and the stop ids."""
    lm: object
    decoders: dict
    prompts: list[list[int]]
    max_new: int
    stop: set[int]
    reference: list[list[int]] = field(default_factory=list)


def batch1_reference(bench: Bench) -> list[list[int]]:
    return [autoregressive_decode(bench.lm, p, bench.max_new, GREEDY, bench.stop).tokens
            for p in tqdm(bench.prompts, desc="batch-1 reference")]


def warm_up(bench: Bench) -> None:
    """First-call costs are not charged to B=1: every decoder and generate() run once on two prompts."""
    for decoder in bench.decoders.values():
        decode_batch(decoder, bench.lm, bench.prompts[:2], 8, [GREEDY] * 2, bench.stop)
    hf_generate_batch(bench.lm, bench.prompts[:2], 8, bench.stop)


def measure(bench: Bench, name: str, b: int, batches: list[list[list[int]]]) -> dict:
    """One decoder (or hf_generate) over the prompts in `batches` of `b`: one runs.csv row, less its repeat."""
    lm, stop = bench.lm, bench.stop
    wall, tokens, steps, row_steps, fed, padded, same, ttft, latency = 0.0, 0, 0, 0, 0, 0, 0, [], []
    # tokens each row fed per decode step (prefill left out); drafting seconds
    widths, drafting = [], 0.0
    for i, batch in enumerate(batches):
        refs = bench.reference[i * b:i * b + len(batch)]
        lm.sync()
        t0 = time.perf_counter()
        if name == "hf_generate":
            outs = hf_generate_batch(lm, batch, bench.max_new, stop)
            lm.sync()
            wall += time.perf_counter() - t0
        else:
            gens, stats = decode_batch(bench.decoders[name], lm, batch, bench.max_new, [GREEDY] * len(batch), stop)
            wall += time.perf_counter() - t0
            outs = [g.tokens for g in gens]
            steps += stats.steps
            row_steps += sum(len(g.steps) for g in gens)
            fed, padded = fed + stats.fed_tokens, padded + stats.padded_tokens
            ttft += [g.ttft for g in gens]
            latency += [sum(s.target_time + s.draft_time + s.overhead_time for s in g.steps) for g in gens]
            widths += [s.forward_tokens for g in gens for s in g.steps[1:]]
            drafting += stats.draft_s
        tokens += sum(map(len, outs))
        same += sum(o == r for o, r in zip(outs, refs))
    return {"batch_size": b, "decoder": name, "wall_s": wall,
            "new_tokens": tokens, "tokens_per_s": tokens / wall, "batch_steps": steps or None,
            "tokens_per_step_per_row": tokens / row_steps if row_steps else None,
            "padding_waste": 1 - fed / padded if padded else None,
            "tokens_fed_per_row_step": statistics.mean(widths) if widths else None,
            "draft_s_per_row_step": drafting / row_steps if row_steps else None,
            "median_ttft_s": statistics.median(ttft) if ttft else None,
            "median_row_latency_s": statistics.median(latency) if latency else None,
            "rows_equal_batch1": same, "rows": len(bench.prompts)}


def timed_runs(bench: Bench, args: argparse.Namespace) -> list[dict]:
    """--repeats passes; in each, every batch size, and at each every decoder and hf_generate in turn."""
    runs = []
    bar = tqdm(total=args.repeats * len(args.batch_sizes) * (len(bench.decoders) + 1), desc="batched runs")
    for repeat in range(args.repeats):
        for b in args.batch_sizes:
            batches = [bench.prompts[i:i + b] for i in range(0, len(bench.prompts), b)]
            if repeat == 0:  # untimed: each batch's prefill shape runs once before any timing
                for batch in batches:
                    decode_batch(bench.decoders["autoregressive"], bench.lm, batch, 2, [GREEDY] * len(batch),
                                 bench.stop)
                    hf_generate_batch(bench.lm, batch, 2, bench.stop)
            for name in [*bench.decoders, "hf_generate"]:
                runs.append({"repeat": repeat, **measure(bench, name, b, batches)})
                bar.update(1)
    bar.close()
    return runs


def speedup_table(runs: list[dict], curve: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs with their speedup over autoregressive in the same pass, the median per batch size and
    decoder with the cost curve's prediction)."""
    runs = pd.DataFrame(runs)
    ar = runs[runs.decoder == "autoregressive"].set_index(["repeat", "batch_size"]).tokens_per_s
    runs["speedup"] = runs.tokens_per_s / runs.set_index(["repeat", "batch_size"]).index.map(ar)
    table = (runs.groupby(["batch_size", "decoder"], sort=False)
             .agg(speedup=("speedup", "median"), speedup_min=("speedup", "min"), speedup_max=("speedup", "max"),
                  tokens_per_s=("tokens_per_s", "median"),
                  tokens_per_step_per_row=("tokens_per_step_per_row", "median"),
                  padding_waste=("padding_waste", "median"),
                  tokens_fed_per_row_step=("tokens_fed_per_row_step", "median"),
                  draft_s_per_row_step=("draft_s_per_row_step", "median"), median_ttft_s=("median_ttft_s", "median"),
                  median_row_latency_s=("median_row_latency_s", "median"),
                  rows_equal_batch1=("rows_equal_batch1", "min"), rows=("rows", "first"))
             .reset_index())
    table["predicted_speedup"] = predicted_speedup(table, curve)
    return runs, table


def grid(table: pd.DataFrame, values: str, decoders: list[str]) -> pd.DataFrame:
    """`values` by decoder (rows, in `decoders`' order) and batch size (columns)."""
    return table.pivot(index="decoder", columns="batch_size", values=values).reindex(decoders)


def markdown(table: pd.DataFrame, curve: pd.DataFrame, decoders: list[str], heading: str) -> str:
    """batch_speedup.md: measured and predicted speedups by batch size, the whole table, the cost curve."""
    return (heading + "\n\n" + grid(table, "speedup", [*decoders, "hf_generate"]).to_markdown(floatfmt=".2f")
            + "\n\nWhat the cost curve predicts (predicted_speedup):\n\n"
            + grid(table, "predicted_speedup", decoders).to_markdown(floatfmt=".2f") + "\n\n"
            + table.to_markdown(index=False, floatfmt=".3f") + "\n\n"
            + curve.pivot(index="tokens_per_row", columns="batch_size",
                          values="cost_vs_one_token").to_markdown(floatfmt=".2f") + "\n")


def main() -> None:
    args, overrides = parse_args()
    if args.replot:
        print(f"plot: {replot(Path(args.replot))}")
        return
    cfg, decoders = run_config(overrides, args.decoders)
    lm = loaded_target(cfg, decoders)
    bench = Bench(lm, decoders, dataset_prompts(lm, cfg, args.prompts), args.max_new_tokens, lm.stop_ids)
    args.out.mkdir(parents=True, exist_ok=True)

    with torch.inference_mode():
        bench.reference = batch1_reference(bench)
        warm_up(bench)
        runs = timed_runs(bench, args)
        curve = cost_curve(lm, args.batch_sizes, args.widths)

    runs, table = speedup_table(runs, curve)
    runs.to_csv(args.out / "runs.csv", index=False)
    table.to_csv(args.out / "batch_speedup.csv", index=False)
    curve.to_csv(args.out / "cost_curve.csv", index=False)
    prompts = len(bench.prompts)
    heading = (f"Speedup over batched autoregressive (median of {args.repeats} interleaved passes), {prompts} "
               f"{cfg.dataset.name} prompts x {bench.max_new} tokens, greedy, {provenance.collect(lm)['dtype']}")
    (args.out / "batch_speedup.md").write_text(markdown(table, curve, [*decoders], heading))
    plot(table, curve, args.out / "batch_speedup.png", f"{cfg.dataset.name}: {setup_of(lm)}")
    meta = provenance.collect(lm)
    meta.update(argv=sys.argv[1:], prompts=prompts, max_new_tokens=bench.max_new, dataset=cfg.dataset.name,
                model=cfg.model.name)
    (args.out / "provenance.json").write_text(json.dumps(meta, indent=2))
    print(grid(table, "speedup", [*decoders, "hf_generate"]).to_markdown(floatfmt=".2f"))


if __name__ == "__main__":
    main()
