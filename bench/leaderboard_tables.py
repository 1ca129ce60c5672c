"""The leaderboard's tables (bench/leaderboard.py says what each column is): a row per entry and
dataset (and overall, and per category), the auto-tuners' forecasts beside what they measured,
each entry's own summary, and leaderboard.md's text. Every figure is computed by bench/metrics.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import torch

from . import metrics, rundir, spec_bench_table
from .metrics import timed_runs
from .registry import REFERENCE

COLUMNS = ["decoder", "dataset", "prompts", "runs", "tokens_per_step", "mean_accepted_tokens",
           "vllm_mean_acceptance_length", "vllm_acceptance_by_position", "sglang_accept_length", "eagle_tau",
           "tokens_per_s",
           "speedup", "speedup_ci_low", "speedup_ci_high", "vs_autoregressive", "overlaps", "speedup_per_run_p25",
           "speedup_per_run_p75", "speedup_geomean", "acceptance_rate",
           "flops_per_token_vs_ar", "decode_overhead_frac", "same_as_autoregressive", "lossless", "lossless_up_to_ties",
           "real_divergences", "quality_metric", "quality"]
# Where a decoding step's time goes (bench/metrics.py, decode_step_ms and in_reference_steps).
TIME_COLUMNS = ["decoder", "dataset", "mean_accepted_tokens", "step_ms", "target_ms", "draft_ms", "other_ms",
                "step_in_ar_steps", "target_in_ar_steps", "draft_in_ar_steps", "other_in_ar_steps", "speedup"]
LOSSLESS_COLUMNS = ["lossless", "lossless_up_to_ties", "real_divergences"]  # bench/metrics.py, lossless_columns
CATEGORY_COLUMNS = COLUMNS[:2] + ["category"] + COLUMNS[2:]


def decoding_mode(gen) -> str:
    if gen.temperature == 0:
        return "greedy"
    return f"sampling (temperature {gen.temperature}, top_p {gen.top_p}, top_k {gen.top_k})"


def machine(lm) -> dict:
    """What leaderboard.md's first line says of the machine that ran the table."""
    return {"device": lm.device, "dtype": str(lm.dtype).replace("torch.", ""),
            "fast path": getattr(lm, "fast_path", "none"), "threads": torch.get_num_threads()}


def cost_line(where: str, cost: pd.DataFrame) -> str:
    costs = ", ".join(f"{k} tokens {v:.2f}x" for k, v in zip(cost["tokens"], cost["vs_one_token"]))
    return f"verification cost on {where} (one forward of k tokens vs 1): {costs}"


def markdown(df: pd.DataFrame, costs: dict[str, pd.DataFrame], base, setup: dict,
             paired: str = "both run in this process") -> str:
    """leaderboard.md: `costs` maps where it was measured (this device, or each node) to its
    verification cost; `setup`, what machine() says (each key's values over the nodes); `paired`,
    where a speedup's two sides ran."""
    shown = df[[c for c in COLUMNS if c in df]].copy()
    shown.loc[~df["decoder_lossless"], "decoder"] += " (lossy)"
    setup = (f"model {base.model.name} | " + " | ".join(f"{k} {v}" for k, v in setup.items()) + " | "
             f"{decoding_mode(base.gen)} | {base.gen.max_new_tokens} new tokens | "
             f"{base.leaderboard.limit} prompts per dataset"
             + (" (every turn)" if base.leaderboard.get("turns", "first") == "all" else " (conversations: first turns)")
             + (f" x {base.leaderboard.repeats} runs each" if base.leaderboard.repeats > 1 else ""))
    lines = "\n".join(cost_line(where, cost) for where, cost in costs.items())
    return (f"{setup}\n\n{lines}\n\n"
            + shown.to_markdown(index=False, floatfmt=".3g")
            + "\n\nruns: timed runs, prompts x repeats; speedup (Spec-Bench's): mean over runs of tokens/s / "
              f"autoregressive's mean over the same prompts and repeats, {paired}; "
              "speedup_ci_low/high: its 95% bootstrap interval over prompts and their repeats; vs_autoregressive: "
              "faster or slower where that interval is above or below 1, else indistinct; overlaps: the entries "
              "whose intervals overlap this one's, which this table does not order; "
              "speedup_per_run_p25/p75: quartiles over runs of tokens/s / autoregressive's on the same prompt and "
              "repeat; speedup_geomean: geometric mean over runs of autoregressive's latency / the decoder's; "
              "mean_accepted_tokens (Spec-Bench's): new tokens per decoding step, prefill excluded, bonus token "
              "included; vllm_mean_acceptance_length, vllm_acceptance_by_position, sglang_accept_length, eagle_tau: "
              "acceptance as vLLM, SGLang and EAGLE's evaluation count it (docs/acceptance.md); "
            + ("same_as_autoregressive: share of prompts whose output equals the autoregressive entry's; "
               "lossless (bench/metrics.py): share of judged prompts identical to autoregressive greedy, "
               f"lossless_up_to_ties: identical or departing only at ties (within {metrics.TIE_ULPS} ulps of the "
               "target's top-1 on the output's own path), real_divergences: outputs with a departure no tie explains; "
               if "lossless" in df else
               "same_as_autoregressive: share of prompts identical to autoregressive's sampled output (with the same "
               "seeds; not a test of losslessness under sampling); ")
            + "flops_per_token_vs_ar: target + draft FLOPs per token vs autoregressive; decode_overhead_frac: share "
              "of decoding-step time (prefill left out) outside the target and draft forwards.\n"
            + "\nWhere a decoding step's time goes (prefill step left out): milliseconds per step in the target's "
              "forward, drafting and the rest (sampling, verification, bookkeeping), and the same in autoregressive "
              "decoding steps on the same prompts (*_in_ar_steps); speedup is about mean_accepted_tokens / "
              "step_in_ar_steps.\n\n"
            + df[[c for c in TIME_COLUMNS if c in df]].to_markdown(index=False, floatfmt=".3g") + "\n")


def run_pairs(pairs: list[tuple[dict, dict]]) -> list[tuple[dict, dict]]:
    """(decoder's, reference's) per-prompt records -> one {new_tokens, latency_s} pair per timed run,
    each repeat against the reference's same repeat."""
    return [({"new_tokens": a["new_tokens"], "latency_s": x}, {"new_tokens": b["new_tokens"], "latency_s": y})
            for a, b in pairs for x, y in zip(timed_runs(a), timed_runs(b))]


def prompt_of(record: dict) -> tuple:
    """A record's prompt and turn, across datasets (the overall row pools them; keys may repeat)."""
    return record.get("dataset"), record["key"]


def board_row(records: list[dict], reference: list[dict]) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    ref = {prompt_of(r): r for r in reference if r["status"] == "ok"}
    pairs = [(r, ref[prompt_of(r)]) for r in ok if prompt_of(r) in ref]
    per_run = run_pairs(pairs)
    run_prompts = [prompt_of(a) for a, b in pairs for _ in zip(timed_runs(a), timed_runs(b))]  # as run_pairs
    runs = [({"new_tokens": r["new_tokens"], "latency_s": x}, prompt_of(r)) for r in ok for x in timed_runs(r)]
    flops_vs_ar = (metrics.total_flops_per_token(ok) / metrics.total_flops_per_token([b for _, b in pairs])
                   if pairs else math.nan)
    split = metrics.decode_step_ms(ok)
    return {
        "prompts": len(ok),
        "runs": sum(len(timed_runs(r)) for r in ok),
        "tokens_per_step": metrics.tokens_per_step(ok),
        "mean_accepted_tokens": metrics.mean_accepted_tokens(ok),
        **metrics.engine_acceptance(ok),
        # every timed run's tokens and seconds (a record's repeats pooled first)
        "tokens_per_s": metrics.pooled_tokens_per_s({"new_tokens": r["new_tokens"] * len(timed_runs(r)),
                                                     "latency_s": sum(timed_runs(r))} for r in ok),
        **metrics.tokens_per_s_interval([run for run, _ in runs], [prompt for _, prompt in runs]),
        **metrics.speedups(per_run),
        **metrics.speedup_interval(per_run, run_prompts),
        **metrics.speedup_per_run(per_run),
        "decode_overhead_frac": metrics.decode_overhead_frac(ok),
        **split,
        **metrics.in_reference_steps(split, metrics.decode_step_ms([b for _, b in pairs])),
        "acceptance_rate": metrics.acceptance_rate(ok),
        "flops_per_token_vs_ar": flops_vs_ar,
        "same_as_autoregressive": metrics.same_output_share(pairs),
        **metrics.lossless_columns(ok),
        "decoder_lossless": metrics.decoder_lossless(ok),
        **metrics.quality(ok),
        "decode_flops_per_step": metrics.decode_flops_per_step(ok),
    }


def table(records: dict, datasets: list[str], labels: list[str], references: dict | None = None) -> pd.DataFrame:
    """records: (dataset, label) -> that entry's records for this run's prompts; references: (dataset,
    label) -> the reference's records its ratios are taken against (default: the reference entry's)."""
    references = references or {}
    rows = []
    for label in labels:
        every, every_ref = [], []
        for ds in datasets:
            recs, ref = records[ds, label], references.get((ds, label), records[ds, REFERENCE])
            if recs:
                rows.append({"decoder": label, "dataset": ds, **board_row(recs, ref)})
            every += recs
            every_ref += ref
        if every:  # quality metrics differ by dataset: no pooled quality
            rows.append({"decoder": label, "dataset": "all", **board_row(every, every_ref),
                         "quality_metric": None, "quality": math.nan})
    return ordering_marks(pd.DataFrame(rows))


def ordering_marks(df: pd.DataFrame, within: tuple[str, ...] = ("dataset",)) -> pd.DataFrame:
    """What the speedup intervals allow a reader to say, per row: vs_autoregressive (faster, slower, or
    indistinct where the interval holds 1) and overlaps (the other entries, in the same `within`
    group, whose intervals overlap this one's: the table does not order them)."""
    if df.empty or "speedup_ci_low" not in df:
        return df
    df = df.copy()
    low, high = df["speedup_ci_low"], df["speedup_ci_high"]
    df["vs_autoregressive"] = ["" if name == REFERENCE or math.isnan(lo) else "faster" if lo > 1 else
                               "slower" if hi < 1 else "indistinct" for name, lo, hi in zip(df["decoder"], low, high)]
    df["overlaps"] = ""
    for _, group in df[df["decoder"] != REFERENCE].groupby(list(within), sort=False):
        found = metrics.overlapping({i: (lo, hi) for i, lo, hi in zip(group.index, group["speedup_ci_low"],
                                                                       group["speedup_ci_high"])})
        for i, others in found.items():
            df.at[i, "overlaps"] = ", ".join(df.at[j, "decoder"] for j in others)
    return df


def category_table(records: dict, datasets: list[str], labels: list[str], references: dict | None = None
                   ) -> pd.DataFrame:
    """The same rows per (decoder, dataset, category), for prompts that carry a category."""
    references = references or {}
    rows = []
    for ds in datasets:
        categories = list(dict.fromkeys(r["category"] for r in records[ds, REFERENCE] if r.get("category")))
        for label in labels:
            reference = references.get((ds, label), records[ds, REFERENCE])
            for cat in categories:
                recs = [r for r in records[ds, label] if r.get("category") == cat]
                if recs:
                    rows.append({"decoder": label, "dataset": ds, "category": cat, **board_row(recs, reference)})
    return ordering_marks(pd.DataFrame(rows), within=("dataset", "category"))


FORECASTS = ("predicted_speedup", "predicted_tokens_per_s", "expected_tokens", "latency_profile", "acceptance")


def tuned_choice(tuned: dict) -> str:
    """What an auto-tuner chose (a record's `tuned`, its forecasts left out), as JSON."""
    return json.dumps({k: v for k, v in tuned.items() if k not in FORECASTS})


def tuning_table(df: pd.DataFrame, records: dict) -> pd.DataFrame:
    """Per self-tuning entry and dataset: what it chose, what it forecast (predicted_speedup,
    expected_tokens) and what was measured (speedup, mean_accepted_tokens) on the scored prompts."""
    rows = []
    for (ds, label), recs in records.items():
        tuned = next((r["tuned"] for r in recs if r.get("tuned")), None)
        if not tuned:
            continue
        measured = df[(df["decoder"] == label) & (df["dataset"] == ds)].iloc[0]
        rows.append({"decoder": label, "dataset": ds, "choice": tuned_choice(tuned),
                     "predicted_speedup": tuned.get("predicted_speedup", math.nan), "speedup": measured["speedup"],
                     "expected_tokens": tuned.get("expected_tokens", math.nan),
                     "mean_accepted_tokens": measured["mean_accepted_tokens"]})
    return pd.DataFrame(rows)


def write_summaries(out_dir: Path, records: dict) -> None:
    for (ds, label), recs in records.items():
        if recs:
            summary = metrics.summarize(recs)
            rundir.write_atomic(out_dir / ds / label / "summary.csv", summary.to_csv(index=False))
            rundir.write_atomic(out_dir / ds / label / "summary.md", metrics.to_markdown(summary) + "\n")


def write_tables(out_dir: Path, records: dict, datasets: list[str], labels: list[str], greedy: bool,
                 references: dict | None = None) -> pd.DataFrame:
    """leaderboard.csv, tuning.csv, Spec-Bench's layout and, where prompts carry categories,
    leaderboard_by_category.csv/.md; returns leaderboard.csv's table. `references`: as table's."""
    df = table(records, datasets, labels, references)
    by_category = category_table(records, datasets, labels, references)
    if not greedy:  # the lossless check is greedy's (check_lossless refuses sampling): no such columns
        df, by_category = (d.drop(columns=[c for c in LOSSLESS_COLUMNS if c in d]) for d in (df, by_category))
    rundir.write_atomic(out_dir / "leaderboard.csv", df.to_csv(index=False))
    # auto-tuners: forecast vs measured
    rundir.write_atomic(out_dir / "tuning.csv", tuning_table(df, records).to_csv(index=False))

    # Spec-Bench's layout, where prompts have categories
    spec_bench_table.write(out_dir, records, datasets, labels, references)
    if len(by_category):
        rundir.write_atomic(out_dir / "leaderboard_by_category.csv", by_category.to_csv(index=False))
        rundir.write_atomic(out_dir / "leaderboard_by_category.md",
            by_category[[c for c in CATEGORY_COLUMNS if c in by_category]]
            .to_markdown(index=False, floatfmt=".3g") + "\n")
    return df
