"""Where a method's greedy output departs from autoregressive's, how close was the call?

    python scripts/divergence_gaps.py LEADERBOARD_DIR [--out FILE]

For every prompt of a leaderboard (or any directory of runs beside an autoregressive one, laid
out as <dataset>/<decoder>/) whose output differs from the autoregressive entry's: the first
divergent position and autoregressive's top-1 minus top-2 logit there, from one fresh forward
at the run's model and dtype (decoders.methods.autoregressive.top_two_logits, untimed), also in units of the
dtype's resolution at that logit (its ulp). A gap of a few ulps is a numerical tie: a k-token
forward and a 1-token forward sum in different orders and round differently, most of all in
bfloat16 (8 bits of mantissa). A clear gap would be a decoding error. Writes a CSV (default
LEADERBOARD_DIR/divergences.csv) and prints it.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.metrics import first_divergence  # noqa: E402
from bench.prompts import render, rendering_for  # noqa: E402
from bench.records import read_records  # noqa: E402
from decoders.methods.autoregressive import top_two_logits  # noqa: E402

REFERENCE = "autoregressive"


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at |x|."""
    eps = torch.finfo(dtype).eps
    return eps * 2.0 ** math.floor(math.log2(abs(x))) if x else torch.finfo(dtype).tiny


def divergences(root: Path) -> pd.DataFrame:
    rows, models = [], {}
    for ref_dir in sorted(root.glob(f"*/{REFERENCE}")):
        reference = {r["key"]: r for r in read_records(ref_dir / "records.jsonl") if r["status"] == "ok"}
        cfg = OmegaConf.load(ref_dir / "config.yaml")
        key = OmegaConf.to_yaml(cfg.model) + str(cfg.dtype) + str(cfg.device)
        if key not in models:
            models.clear()  # one model in memory at a time
            models[key] = instantiate(cfg.model).load()
        lm = models[key]
        prompts = {p.id: p for p in instantiate(cfg.dataset).load()}
        rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
        for run in sorted(p for p in ref_dir.parent.iterdir() if p.is_dir() and p.name != REFERENCE):
            if not (run / "records.jsonl").is_file():
                continue
            for r in read_records(run / "records.jsonl"):
                ref = reference.get(r["key"])
                if r["status"] != "ok" or ref is None or r["tokens"] == ref["tokens"]:
                    continue
                at = first_divergence(r["tokens"], ref["tokens"])
                ids = render(lm.tokenizer, prompts[r["prompt_id"]], r["turn"], [], rendering)[1]
                context = list(ids) + ref["tokens"][:at]
                with torch.inference_mode():
                    top, second = top_two_logits(lm, context)
                gap = top - second if at < len(ref["tokens"]) else math.nan
                rows.append({"dataset": ref_dir.parent.name, "decoder": run.name, "prompt": r["prompt_id"],
                             "first_divergence": at, "new_tokens": len(ref["tokens"]), "logit_gap": gap,
                             "top_logit": top, "gap_in_ulps": gap / ulp(top, lm.dtype) if not math.isnan(gap) else math.nan,
                             "dtype": str(lm.dtype).replace("torch.", "")})
    return pd.DataFrame(rows, columns=["dataset", "decoder", "prompt", "first_divergence", "new_tokens", "logit_gap",
                                       "top_logit", "gap_in_ulps", "dtype"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="a leaderboard out_dir: <dataset>/<decoder>/records.jsonl")
    parser.add_argument("--out", help="CSV file (default ROOT/divergences.csv)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not any(root.glob(f"*/{REFERENCE}/records.jsonl")):
        raise SystemExit(f"error: no {REFERENCE}/records.jsonl under {root}/<dataset>/: give a leaderboard out_dir")
    df = divergences(root)
    out = Path(args.out) if args.out else root / "divergences.csv"
    df.to_csv(out, index=False)
    print(df.to_markdown(index=False, floatfmt=".3g") if len(df) else "every output equals autoregressive's")
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
