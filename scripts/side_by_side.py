"""Methods timed side by side on the same prompts in one process (shared by the benchmark scripts).

Every method runs `repeats` times per prompt in a rotating order (so no method always runs
first or last), after one untimed warm-up of each. speedup is bench.metrics' (Spec-Bench's:
mean tokens/s over every run / autoregressive's mean over the same runs); its spread is the
per-run ratio against autoregressive on the same prompt and repeat (speedup_per_run_median,
_p25, _p75).
"""
from __future__ import annotations

import statistics

from bench_baselines import quartiles, timed

from bench.metrics import speedups
from decoders.autoregressive import logit_gap


def divergence_margin(lm, prompt: list[int], reference: list[int], other: list[int]) -> float | None:
    """Where `other` first departs from the autoregressive `reference`: the gap between the
    reference's top two logits there (decoders.autoregressive.logit_gap). None if they never depart."""
    k = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    return None if k is None else logit_gap(lm, prompt + reference[:k])


def compare(lm, runs: dict, prompts: list[list[int]], repeats: int, max_new_tokens: int, sampling) -> list[dict]:
    """runs: label -> decoder, including "autoregressive". One row per label: tokens/s, speedup
    median and quartiles, tokens per step, draft acceptance, identical-to-AR count and the
    largest AR top-2 logit gap where an output departs."""
    tok_s = {m: [] for m in runs}
    ratio = {m: [] for m in runs}
    pairs = {m: [] for m in runs}  # (this run, autoregressive's run) as {new_tokens, latency_s}
    total = {m: {"tokens": 0, "steps": 0, "seconds": 0.0, "drafts": 0, "accepted": 0, "identical": 0} for m in runs}
    margins = {m: [] for m in runs}
    for i, ids in enumerate(prompts):
        if i == 0:
            for dec in runs.values():
                dec.generate(lm, ids, 16, sampling, lm.stop_ids)
        for rep in range(repeats):
            order = list(runs)
            shift = (i * repeats + rep) % len(order)
            order = order[shift:] + order[:shift]
            result = {m: timed(lambda d=runs[m]: d.generate(lm, ids, max_new_tokens, sampling, lm.stop_ids))
                      for m in order}
            ref_gen, ref_t = result["autoregressive"]
            for m, (gen, t) in result.items():
                tok_s[m].append(len(gen.tokens) / t)
                pairs[m].append(({"new_tokens": len(gen.tokens), "latency_s": t},
                                 {"new_tokens": len(ref_gen.tokens), "latency_s": ref_t}))
                ratio[m].append(tok_s[m][-1] / (len(ref_gen.tokens) / ref_t))
                tot = total[m]
                tot["tokens"] += len(gen.tokens)
                tot["steps"] += len(gen.steps)
                tot["seconds"] += t
                tot["drafts"] += sum(s.draft_tokens for s in gen.steps)
                tot["accepted"] += sum(s.accepted_draft_tokens for s in gen.steps)
                tot["identical"] += gen.tokens == ref_gen.tokens
                if sampling.greedy and gen.tokens != ref_gen.tokens:
                    margin = divergence_margin(lm, ids, ref_gen.tokens, gen.tokens)
                    if margin is not None:
                        margins[m].append(margin)
    rows = []
    for m in runs:
        lo, hi = quartiles(ratio[m])
        tot = total[m]
        rows.append({"method": m, "runs": len(ratio[m]), "tok_s": tot["tokens"] / tot["seconds"],
                     "speedup": speedups(pairs[m])["speedup"],
                     "speedup_per_run_median": statistics.median(ratio[m]), "speedup_per_run_p25": lo,
                     "speedup_per_run_p75": hi,
                     "tok_per_step": tot["tokens"] / tot["steps"],
                     "acceptance": tot["accepted"] / tot["drafts"] if tot["drafts"] else float("nan"),
                     "identical_to_ar": f"{tot['identical']}/{len(ratio[m])}",
                     "max_divergence_margin": max(margins[m], default=float("nan"))})
    return rows


LEGEND = ("speedup = mean tokens/s over runs / autoregressive's mean (Spec-Bench's); speedup_per_run = tokens/s / "
          "autoregressive tokens/s on the same prompt and repeat (median, quartiles); "
          "acceptance = accepted / proposed draft tokens; identical_to_ar = runs whose greedy output equals "
          "autoregressive's; max_divergence_margin = the largest gap between autoregressive's top two logits "
          "where an output departs from it")


def print_dataset(rows: list[dict], name: str) -> None:
    """One dataset's rows as soon as they are measured (a long benchmark shows results as it goes)."""
    import pandas as pd

    print(pd.DataFrame([r for r in rows if r["dataset"] == name]).to_string(index=False, float_format="%.3f"), flush=True)


def print_table(rows: list[dict], legend: str = LEGEND) -> None:
    """All rows as the Markdown table the README quotes, after its legend."""
    import pandas as pd

    print(f"\n{legend}\n")
    print(pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3f"))
