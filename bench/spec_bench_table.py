"""The leaderboard's figures in Spec-Bench's layout (its evaluation/speed.py): one column per task
group plus Overall, a row per method, the speedup's mean and standard deviation over the timed
runs, and mean accepted tokens. Written beside leaderboard.csv/.md as spec_bench.csv/.md, for
every dataset whose prompts carry a category.

As in Spec-Bench, a question is one unit however many turns it has: its tokens and seconds are
summed over its turns. Run r's speedup is `metrics.speedups` over the questions (Spec-Bench's:
mean per-question tokens/s over the reference's, both from run r, i.e. repeat r of the
leaderboard's rotation); the table gives its mean and sample standard deviation (ddof 1) over the
runs. Mean accepted tokens is `metrics.mean_accepted_tokens` over every turn's steps.

The reference's tokens are counted as speed.py counts the baseline's: not its generated tokens but
its answer text encoded again, less one (`speed_py_tokens`, kept in each record), while a method's
are its generated ones (speed.py reads them from the method's answers). The two counts differ by
the EOS token (not in the text), what encoding the text again merges or splits, and the one less
(Llama's BOS; a real token for a tokenizer that adds none, as SmolLM2's): on SmolLM2's
autoregressive answers -0.8 to -2.1% of the generated count at 97-128 tokens a turn, -0.13% at
878, so the speedups read 0.1-2% higher. The reference's own row is therefore not exactly 1.00x:
it shows what the rule moves. Records from before 2026-12-02 lack the field: a cell where any of
the reference's records lacks it counts generated tokens, and `reference_tokens` says which count
each cell used.

Every question runs (Spec-Bench's 480, both turns of MT-Bench's): a generation that reaches the
model's context stops there (stop_reason "context") and counts with the tokens it made, as in
Spec-Bench; the one skip is a prompt that fills the context by itself. Only questions whose every
turn ran for both the method and the reference count, and the table says how many of how many
that is, which were skipped and how many turns stopped at the context.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from . import metrics, rundir
from .datasets import SPEC_BENCH_GROUPS
from .metrics import timed_runs
from .registry import REFERENCE

OVERALL = "Overall"


def columns(categories: list[str]) -> dict[str, tuple[str, ...]]:
    """Column -> the categories it pools: Spec-Bench's six task groups where present, then any
    other category as its own column, then Overall (every category)."""
    cols = {name: tuple(c for c in cats if c in categories) for name, cats in SPEC_BENCH_GROUPS.items()}
    cols = {name: cats for name, cats in cols.items() if cats}
    grouped = {c for cats in cols.values() for c in cats}
    cols.update({c: (c,) for c in categories if c not in grouped})
    cols[OVERALL] = tuple(categories)
    return cols


def speed_py_tokens(tokenizer, text: str) -> int:
    """A turn's tokens as Spec-Bench's evaluation/speed.py counts the baseline's: the answer as its
    answer files keep it (stripped) encoded again with the tokenizer's special tokens, less one (the
    BOS of the Llama tokenizers it was written for; one real token where a tokenizer adds none)."""
    return len(tokenizer(text.strip())["input_ids"]) - 1


def by_question(records: list[dict]) -> dict[str, list[dict]]:
    """prompt_id -> its turns' records, in turn order."""
    by_id: dict[str, list[dict]] = {}
    for r in records:
        by_id.setdefault(r["prompt_id"], []).append(r)
    return {q: sorted(rs, key=lambda r: r["turn"]) for q, rs in by_id.items()}


def _questions(records: list[dict]) -> dict[str, list[dict]]:
    """prompt_id -> its turns' records, for questions whose every recorded turn is ok."""
    return {q: rs for q, rs in by_question(records).items() if all(r["status"] == "ok" for r in rs)}


def cell(records: list[dict], reference: list[dict]) -> dict:
    """One method's figures over one column's records, against the reference's."""
    mine, ref = _questions(records), _questions(reference)
    common = [q for q in mine if q in ref and len(mine[q]) == len(ref[q])]
    runs = min((len(timed_runs(r)) for q in common for r in mine[q] + ref[q]), default=0)
    counted = "speed_py_tokens" if all(r.get("speed_py_tokens") is not None for q in common for r in ref[q]) \
        else "new_tokens"  # speed.py's count of the baseline's tokens where every record has it
    per_run = []
    for k in range(runs):
        pairs = [({"new_tokens": sum(r["new_tokens"] for r in mine[q]),
                   "latency_s": sum(timed_runs(r)[k] for r in mine[q])},
                  {"new_tokens": sum(r[counted] for r in ref[q]),
                   "latency_s": sum(timed_runs(r)[k] for r in ref[q])})
                 for q in common]
        per_run.append(metrics.speedups(pairs)["speedup"])
    asked = {r["prompt_id"] for r in records + reference}
    skipped = sorted(q for q in asked if any(r["status"] != "ok" for r in by_question(records + reference).get(q, [])))
    return {"questions": len(common), "of": len(asked), "skipped": len(skipped), "skipped_ids": " ".join(skipped),
            "context_stops": sum(r.get("stop_reason") == "context" for q in common for r in mine[q]), "runs": runs,
            "reference_tokens": "text encoded again (speed.py)" if counted == "speed_py_tokens" else "generated",
            "speedup_mean": float(np.mean(per_run)) if per_run else math.nan,
            "speedup_std": float(np.std(per_run, ddof=1)) if len(per_run) > 1 else math.nan,
            "mean_accepted_tokens": metrics.mean_accepted_tokens([r for q in common for r in mine[q]])}


def table(records: dict, datasets: list[str], labels: list[str], references: dict | None = None) -> pd.DataFrame:
    """records: (dataset, label) -> that entry's records; references: (dataset, label) -> the
    reference's records its ratios are taken against (default: the reference entry's own). A row
    per (dataset, decoder, column)."""
    references = references or {}
    rows = []
    for ds in datasets:
        categories = list(dict.fromkeys(r["category"] for r in records[ds, REFERENCE] if r.get("category")))
        if not categories:
            continue
        for label in labels:
            reference = references.get((ds, label), records[ds, REFERENCE])
            for name, cats in columns(categories).items():
                rows.append({"dataset": ds, "decoder": label, "column": name,
                             **cell([r for r in records[ds, label] if r.get("category") in cats],
                                    [r for r in reference if r.get("category") in cats])})
    return pd.DataFrame(rows)


def wide(df: pd.DataFrame, figure: str) -> pd.DataFrame:
    """Spec-Bench's layout for one figure: a row per (dataset, decoder), a column per task group."""
    out = df.pivot(index=["dataset", "decoder"], columns="column", values=figure)
    rows = list(dict.fromkeys(zip(df["dataset"], df["decoder"])))
    out = out.loc[rows, list(dict.fromkeys(df["column"]))].reset_index()  # the table's own order
    out.columns.name = None
    return out


def markdown(df: pd.DataFrame) -> str:
    parts = []
    for ds, part in df.groupby("dataset", sort=False):
        runs = int(part["runs"].min())
        questions = ", ".join(f"{c} {n}" for c, n in part[part["decoder"] == REFERENCE][["column", "questions"]].values)
        speed = part.assign(shown=[f"{m:.2f}x" + (f" ± {s:.2f}" if not math.isnan(s) else "")
                                   for m, s in zip(part["speedup_mean"], part["speedup_std"])])
        parts += [f"### {ds}: speedup over {REFERENCE} (mean ± std over {runs} run{'s' if runs != 1 else ''})\n",
                  wide(speed, "shown").drop(columns="dataset").to_markdown(index=False),
                  f"\n### {ds}: mean accepted tokens\n",
                  wide(part, "mean_accepted_tokens").drop(columns="dataset").to_markdown(index=False, floatfmt=".2f"),
                  f"\nquestions per column: {questions}; the reference's tokens: "
                  f"{' / '.join(dict.fromkeys(part['reference_tokens']))}\n",
                  coverage(part)]
    return ("Spec-Bench's layout (evaluation/speed.py): a question's turns are summed; run r's speedup is the mean "
            "per-question tokens/s over the reference's in the same run, the reference's tokens counted as speed.py "
            "counts the baseline's where its records allow (its answers' text encoded again, less one: then the "
            "reference's own row is not exactly 1.00x); mean accepted tokens: new tokens per decoding step, "
            "prefill excluded, bonus token included.\n\n" + "\n".join(parts))


def coverage(part: pd.DataFrame) -> str:
    """One dataset's coverage, per decoder (its Overall column): the questions its figures count of
    those asked, the skipped ones, and the turns stopped at the context."""
    lines = ["coverage (a question, both turns of MT-Bench's, counts when every turn ran for the decoder and the "
             "reference; a turn stopped at the context counts with the tokens it made, as in Spec-Bench):"]
    for row in part[part["column"] == OVERALL].itertuples():
        ids = row.skipped_ids.split()
        shown = " ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")
        lines.append(f"- {row.decoder}: {row.questions} of {row.of} questions; {row.skipped} skipped"
                     + (f" ({shown}: each record says why)" if ids else "")
                     + f"; {row.context_stops} turn{'s' if row.context_stops != 1 else ''} stopped at the context")
    return "\n".join(lines) + "\n"


FIGURES = ("speedup_mean", "speedup_std", "mean_accepted_tokens")
COVERAGE = ("questions", "of", "skipped", "context_stops")


def csv_layout(df: pd.DataFrame) -> pd.DataFrame:
    """A row per (dataset, decoder); per column `<column> <figure>` for each of FIGURES, then runs and
    the Overall column's COVERAGE."""
    out = None
    for figure in FIGURES:
        part = wide(df, figure)
        part.columns = [c if c in ("dataset", "decoder") else f"{c} {figure}" for c in part.columns]
        out = part if out is None else out.merge(part, on=["dataset", "decoder"], sort=False)
    order = ["dataset", "decoder"] + [f"{c} {f}" for c in dict.fromkeys(df["column"]) for f in FIGURES]
    runs = df.groupby(["dataset", "decoder"], sort=False)["runs"].min().reset_index()
    covered = df[df["column"] == OVERALL][["dataset", "decoder", *COVERAGE, "reference_tokens"]]
    return out[order].merge(runs, on=["dataset", "decoder"], sort=False).merge(covered, on=["dataset", "decoder"],
                                                                               sort=False)


def write(out_dir: Path, records: dict, datasets: list[str], labels: list[str],
          references: dict | None = None) -> pd.DataFrame:
    """spec_bench.csv and spec_bench.md in Spec-Bench's layout; nothing where no dataset has categories."""
    df = table(records, datasets, labels, references)
    if len(df):
        rundir.write_atomic(out_dir / "spec_bench.csv", csv_layout(df).to_csv(index=False))
        rundir.write_atomic(out_dir / "spec_bench.md", markdown(df))
    return df
