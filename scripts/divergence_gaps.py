"""Where a method's greedy output departs from autoregressive's, how close was the call?

    python scripts/divergence_gaps.py LEADERBOARD_DIR [--out FILE]

For every prompt of a leaderboard (or any directory of runs beside an autoregressive one, laid
out as <dataset>/<decoder>/) whose output differs from the autoregressive entry's: the first
divergent position and the lossless check's verdict (bench/metrics.py, judge_output), from
autoregressive's own one-token forwards replayed along the output at the run's model and dtype
(decoders.methods.autoregressive.step_logits, untimed): there, the top-1 minus top-2 logit and
the top-1 minus the chosen token's logit in units of the dtype's resolution at the top-1 logit
(divergence_ulps); past it, the first token that no tie explains (first_real_divergence), and
whether the output departs at ties only (divergence_tie, within metrics.TIE_ULPS). A k-token
forward and a 1-token forward sum in different orders and round differently, most of all in
bfloat16 (8 bits of mantissa); a clear gap would be a decoding error. Writes a CSV (default
LEADERBOARD_DIR/divergences.csv) and prints it, then each decoder's lossless_up_to_ties and
real_divergences.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from bench.errors import BenchError, fail
from bench.metrics import lossless_columns
from bench.prompts import render, rendering_for
from bench.records import read_records, records_path, run_dirs
from bench.registry import REFERENCE
from bench.rundir import recorded_config
from bench.runner import judge_lossless, recorded_spec
from bench.usage import Parser

COLUMNS = ["dataset", "decoder", "prompt", "key", "first_divergence", "new_tokens", "divergence_logit_gap",
           "divergence_ulps", "first_real_divergence", "ties_in_wider_dtype", "divergence_tie", "dtype"]


def divergences(root: Path) -> pd.DataFrame:
    rows, models = [], {}
    for ref_dir in sorted(root.glob(f"*/{REFERENCE}")):
        reference = {r["key"]: r for r in read_records(records_path(ref_dir)) if r["status"] == "ok"}
        _, cfg = recorded_config(ref_dir, "run directory") or (None, None)
        if cfg is None:
            raise BenchError(f"{ref_dir} has no config.yaml: give a leaderboard out_dir")
        key = repr(cfg.get("model")) + str(cfg.get("dtype")) + str(cfg.get("device"))
        if key not in models:
            models.clear()  # one model in memory at a time
            models[key] = recorded_spec(ref_dir, "model", compile="none").load()
        lm = models[key]
        prompts = {p.id: p for p in recorded_spec(ref_dir, "dataset").load()}
        rendering = rendering_for(lm.tokenizer, cfg.get("prompt_format", "auto"))
        for run in sorted(p for p in ref_dir.parent.iterdir() if p.is_dir() and p.name != REFERENCE):
            if not records_path(run).is_file():
                continue
            records = {r["key"]: r for r in read_records(records_path(run))}
            for r in records.values():
                ref = reference.get(r["key"])
                if r["status"] != "ok" or ref is None or r["tokens"] == ref["tokens"]:
                    continue
                # a later turn renders the run's own earlier answers, as the runner did
                previous = [records[f"{r['prompt_id']}#{t}"]["text"] for t in range(r["turn"])]
                ids = render(lm.tokenizer, prompts[r["prompt_id"]], r["turn"], previous, rendering)[1]
                verdict = judge_lossless(lm, ids, r["tokens"], ref["tokens"])
                rows.append({"dataset": ref_dir.parent.name, "decoder": run.name, "prompt": r["prompt_id"],
                             "key": r["key"], "new_tokens": len(ref["tokens"]),
                             "dtype": str(lm.dtype).replace("torch.", ""),
                             **{k: verdict[k] for k in COLUMNS if k in verdict}})
    return pd.DataFrame(rows, columns=COLUMNS)


def per_decoder(root: Path, df: pd.DataFrame) -> pd.DataFrame:
    """lossless, lossless_up_to_ties and real_divergences per (dataset, decoder), the run summaries' names."""
    rows = []
    for ref_dir in sorted(root.glob(f"*/{REFERENCE}")):
        reference = {r["key"] for r in read_records(records_path(ref_dir)) if r["status"] == "ok"}
        for run in sorted(p for p in ref_dir.parent.iterdir() if p.is_dir() and p.name != REFERENCE):
            if not records_path(run).is_file():
                continue
            judged = df[(df["dataset"] == ref_dir.parent.name) & (df["decoder"] == run.name)]
            verdicts = dict(zip(judged["key"], judged["divergence_tie"]))
            records = [{"lossless": r["key"] not in verdicts, "divergence_tie": verdicts.get(r["key"])}
                       for r in read_records(records_path(run)) if r["status"] == "ok" and r["key"] in reference]
            rows.append({"dataset": ref_dir.parent.name, "decoder": run.name, **lossless_columns(records)})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    parser = Parser(__doc__, prog="python scripts/divergence_gaps.py")
    parser.add_argument("root", help="a leaderboard out_dir: <dataset>/<decoder>/records.jsonl")
    parser.add_argument("--out", help="CSV file (default ROOT/divergences.csv)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not run_dirs(root, f"*/{REFERENCE}"):
        raise BenchError(f"no {REFERENCE}/records.jsonl under {root}/<dataset>/: give a leaderboard out_dir")
    df = divergences(root)
    out = Path(args.out) if args.out else root / "divergences.csv"
    df.to_csv(out, index=False)
    print(df.to_markdown(index=False, floatfmt=".3g") if len(df) else "every output equals autoregressive's")
    print("\n" + per_decoder(root, df).to_markdown(index=False, floatfmt=".3g"))
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        fail(e)
