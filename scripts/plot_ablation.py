"""Sequoia's ablation plots from sweep results (conf/sweep/{sequoia,specinfer,chain}_budget.yaml,
conf/sweep/sampling_robustness.yaml):

    python scripts/plot_ablation.py SWEEP_DIR... [--out DIR]

1. tokens per step vs tree budget (draft nodes per step: the chain's depth, SpecInfer's num_drafts x depth,
   Sequoia's budget), one line per decoder, log-x: budget_vs_tokens_per_step.png + .csv.
2. tokens per step vs temperature, one line per decoder and top-p:
   sampling_robustness.png + .csv (only when the runs vary gen.temperature).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from omegaconf import OmegaConf

from bench.scaling import find_runs
from bench.usage import Parser

DRAFT_DECODERS = ("spec_chain", "specinfer", "sequoia")


def budget(decoder) -> int:
    """Draft nodes per step: the chain's depth, SpecInfer's num_drafts x depth (before merging), Sequoia's
    budget. Runs made before the keys were renamed say k for the first two."""
    return {"spec_chain": lambda d: d.get("depth", d.get("k")),
            "specinfer": lambda d: d.get("num_drafts", d.get("k")) * d.depth,
            "sequoia": lambda d: d.budget}[decoder.name](decoder)


def load(paths) -> pd.DataFrame:
    """One row per finished draft-decoder run: its summary plus the settings that vary."""
    rows = []
    for run in find_runs(paths):
        config = OmegaConf.load(run / "config.yaml")
        for row in pd.read_csv(run / "summary.csv").to_dict("records"):
            if row["decoder"] not in DRAFT_DECODERS:
                continue
            row.update(temperature=float(config.gen.temperature), top_p=float(config.gen.top_p),
                       budget=budget(config.decoder), run=str(run))
            decode = row.get("mean_accepted_tokens", row.get("decode_tokens_per_step"))  # the older name too
            if decode is not None and pd.notna(decode):
                row["tokens_per_step"] = decode
            rows.append(row)
    if not rows:
        raise SystemExit(f"error: no spec_chain / specinfer / sequoia runs under {' '.join(map(str, paths))}")
    return pd.DataFrame(rows)


def plot_budget(df: pd.DataFrame, out: Path) -> Path:
    greedy = df[df["temperature"] == 0].sort_values("budget")
    cols = ["decoder", "model", "dataset", "budget", "tokens_per_step", "acceptance_rate", "tokens_per_s", "run"]
    greedy[cols].to_csv(out / "budget_vs_tokens_per_step.csv", index=False)
    fig, ax = plt.subplots(figsize=(6, 4))
    for decoder, group in greedy.groupby("decoder"):
        ax.plot(group["budget"], group["tokens_per_step"], marker="o", label=decoder)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (draft nodes per step)")
    ax.set_ylabel("mean accepted tokens (decode steps)")
    ax.set_title(" / ".join(sorted(set(greedy["model"]) | set(greedy["dataset"]))))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "budget_vs_tokens_per_step.png"
    fig.savefig(path, dpi=120)
    return path


def plot_sampling(df: pd.DataFrame, out: Path) -> Path | None:
    if df["temperature"].nunique() < 2:
        return None
    cols = ["decoder", "temperature", "top_p", "tokens_per_step", "acceptance_rate", "run"]
    df.sort_values(["decoder", "top_p", "temperature"])[cols].to_csv(out / "sampling_robustness.csv", index=False)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (decoder, top_p), group in df.groupby(["decoder", "top_p"]):
        group = group.sort_values("temperature")
        ax.plot(group["temperature"], group["tokens_per_step"], marker="o", linestyle="-" if top_p == 1 else "--",
                label=f"{decoder}, top-p {top_p:g}")
    ax.set_xlabel("temperature")
    ax.set_ylabel("mean accepted tokens (decode steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "sampling_robustness.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    parser = Parser(__doc__, prog="python scripts/plot_ablation.py")
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--out", default=None, help="default: the first path")
    args = parser.parse_args()
    out = Path(args.out or args.paths[0])
    out.mkdir(parents=True, exist_ok=True)
    df = load(args.paths)
    for path in (plot_budget(df, out), plot_sampling(df, out)):
        if path:
            print(f"wrote {path} and {path.with_suffix('.csv').name}")


if __name__ == "__main__":
    main()
