"""The GPU kit's big-target check: every decoder on random weights of a real model's shape (default
Vicuna-7B's, drawn on the device: no checkpoint travels), a few Spec-Bench questions each with
check_lossless, all in one process. Per decoder: lossless up to ties, tokens per step, the time of
a step split into the target's forwards, the draft's and the harness's own work (records'
overhead_time_s), and the peak GPU memory against the harness's load-time estimate.

    python scripts/gpu/big_target.py --out DIR [--shape vicuna-7b|tiny] [--decoders a,b] [--limit N]
        [--max-new-tokens N] [--tokenizer DIR] [hydra overrides...]

Random weights have no trained drafts: EAGLE's draft (EAGLE-1's layout: fc over [feature; token]
+ one decoder layer), Medusa's heads (Medusa-1's: five one-block heads) and the self-draft are
untrained at full width, so acceptance is near zero and the figures are about cost and
correctness, not speed. The vocabulary is the borrowed tokenizer's (SmolLM2's 49152, not
Vicuna's 32000). Writes DIR/<decoder>/ (a run directory each), DIR/big_target.csv and .md.
"""
from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from bench.models import borrow_tokenizer
from bench.records import read_records
from bench.registry import decoder_configs
from bench.runner import run
from bench.shapes import SHAPES, untrained
from bench.usage import Parser, stop_if_parse_only

REPO = Path(__file__).resolve().parents[2]

COMMON = ["dataset=spec_bench", "check_lossless=true", "quality=false", "progress=false", "warmup=true"]


def per_step(records: list[dict]) -> dict:
    """Milliseconds per step (all steps of the ok records, prefill included) by where they went."""
    ok = [r for r in records if r.get("status") == "ok"]
    steps = sum(r["steps"] for r in ok)
    if not steps:
        return {}
    ms = {f"{k}_ms_per_step": 1e3 * sum(r[f"{k}_time_s"] for r in ok) / steps for k in ("target", "draft", "overhead")}
    return {"records": len(ok), "tokens_per_step": sum(r["new_tokens"] for r in ok) / steps, **ms,
            "tokens_per_s": sum(r["new_tokens"] for r in ok) / sum(r["latency_s"] for r in ok)}


def check_one(decoder: str, out: Path, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"decoder={decoder}", *overrides, *COMMON, *untrained(decoder)])
    cuda = torch.cuda.is_available() and str(cfg.device) != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    summary = run(cfg, out / decoder).iloc[0]
    row = {"decoder": decoder, "wall_s": time.perf_counter() - start,
           "lossless_up_to_ties": float(summary["lossless_up_to_ties"]),
           "real_divergences": int(summary["real_divergences"]),
           **per_step(read_records(out / decoder / "records.jsonl"))}
    estimate = json.loads((out / decoder / "provenance.json").read_text()).get("memory_estimate_bytes") or {}
    row["estimate_gib"] = sum(estimate.values()) / 2**30 if estimate else None
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> None:
    parser = Parser(__doc__, prog="python scripts/gpu/big_target.py", overrides=True)
    parser.add_argument("--out")
    parser.add_argument("--print-model", action="store_true",
                        help="print the model's overrides (the shape's and the tokenizer's), one a line, and stop")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vicuna-7b")
    parser.add_argument("--decoders", default="all", help="comma-separated, or all (bench/registry.py's)")
    parser.add_argument("--limit", type=int, default=2, help="Spec-Bench questions per decoder")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tokenizer", help="a saved tokenizer directory to borrow (the GPU kit's)")
    args, extra = parser.parse_known_args()
    stop_if_parse_only()
    model = ["model=tiny-random", *SHAPES[args.shape], *borrow_tokenizer(args.tokenizer)]
    if args.print_model:
        print("\n".join(model))
        return
    if not args.out:
        parser.error("--out is required")
    every = list(decoder_configs())
    decoders = every if args.decoders == "all" else args.decoders.split(",")
    unknown = sorted(set(decoders) - set(every))
    if unknown:
        parser.error(f"unknown decoders {', '.join(unknown)}; allowed: {', '.join(every)}")
    # autoregressive first: a failure of the plain path explains the rest's.
    decoders.sort(key=lambda d: d != "autoregressive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*model, f"dataset.limit={args.limit}",
                 f"gen.max_new_tokens={args.max_new_tokens}", *extra]
    rows = []
    for decoder in decoders:
        try:
            row = check_one(decoder, out, overrides)
        except Exception as e:  # one decoder's failure is a finding, not the end of the check
            traceback.print_exc()
            row = {"decoder": decoder, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        table = pd.DataFrame(rows)  # written after each decoder: a timed-out check keeps what ran
        table.to_csv(out / "big_target.csv", index=False)
        (out / "big_target.md").write_text(table.to_markdown(index=False, floatfmt=".3g") + "\n")
        if torch.cuda.is_available():  # the last decoder's memory freed before the next one's peak is read
            gc.collect()  # half a second on a CPU with torch loaded: only where it frees device memory
            torch.cuda.empty_cache()
    failed = [r["decoder"] for r in rows if "error" in r or r.get("real_divergences")]
    print(f"big target ({args.shape}): {len(rows) - len(failed)} of {len(rows)} decoders ran lossless up to ties"
          + (f"; failed or diverged: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
