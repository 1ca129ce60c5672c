"""Sequoia's ablation plots from sweep results (conf/sweep/{sequoia,specinfer,chain}_budget.yaml,
conf/sweep/sampling_robustness.yaml):

    python scripts/plot_ablation.py SWEEP_DIR... [--out DIR]
    python scripts/plot_ablation.py --replot DIR     (the budget plot again from DIR's CSV)

1. tokens per step vs tree budget (draft nodes per step: the chain's depth, SpecInfer's num_drafts x depth,
   Sequoia's budget), one line per decoder, log-x: budget_vs_tokens_per_step.png + .csv.
2. tokens per step vs temperature, one line per decoder and top-p:
   sampling_robustness.png + .csv (only when the runs vary gen.temperature).
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from bench.plotting import entry_styles, legend_beside, pyplot, save, setup, title
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


def where(df: pd.DataFrame, provenance: dict) -> str:
    """The dataset, model, device and dtype of the runs (`provenance`: one run's provenance.json)."""
    return f"{'/'.join(sorted(set(df['dataset'])))}: {setup(provenance, '/'.join(sorted(set(df['model']))))}"


def plot_budget(df: pd.DataFrame, out: Path, provenance: dict) -> Path:
    greedy = df[df["temperature"] == 0].sort_values("budget") if "temperature" in df else df.sort_values("budget")
    cols = ["decoder", "model", "dataset", "budget", "tokens_per_step", "acceptance_rate", "tokens_per_s", "run"]
    greedy[cols].to_csv(out / "budget_vs_tokens_per_step.csv", index=False)
    fig, ax = pyplot().subplots(figsize=(6, 4), layout="constrained")
    styles = entry_styles(DRAFT_DECODERS)
    for decoder, group in greedy.groupby("decoder"):
        ax.plot(group["budget"], group["tokens_per_step"], label=decoder, **styles[decoder])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (draft tokens per step)")
    ax.set_ylabel("mean accepted tokens per decoding step (tokens)")
    title(ax, "Tokens per step against the draft budget, greedy", where(greedy, provenance))
    ax.grid(alpha=0.3)
    legend_beside(ax)
    return save(fig, out / "budget_vs_tokens_per_step.png", dpi=120)


def plot_sampling(df: pd.DataFrame, out: Path, provenance: dict) -> Path | None:
    if df["temperature"].nunique() < 2:
        return None
    cols = ["decoder", "temperature", "top_p", "tokens_per_step", "acceptance_rate", "run"]
    df.sort_values(["decoder", "top_p", "temperature"])[cols].to_csv(out / "sampling_robustness.csv", index=False)
    fig, ax = pyplot().subplots(figsize=(6, 4), layout="constrained")
    groups = list(df.groupby(["decoder", "top_p"]))
    styles = entry_styles([key for key, _ in groups])
    for (decoder, top_p), group in groups:
        group = group.sort_values("temperature")
        ax.plot(group["temperature"], group["tokens_per_step"], linestyle="-" if top_p == 1 else "--",
                label=f"{decoder}, top-p {top_p:g}", **styles[decoder, top_p])
    ax.set_xlabel("sampling temperature (0: greedy)")
    ax.set_ylabel("mean accepted tokens per decoding step (tokens)")
    title(ax, "Tokens per step against the sampling settings", where(df, provenance))
    ax.grid(alpha=0.3)
    legend_beside(ax)
    return save(fig, out / "sampling_robustness.png", dpi=120)


def run_provenance(runs) -> dict:
    """The first run's provenance.json (the device and dtype every run of the sweeps shares)."""
    path = next((Path(run) / "provenance.json" for run in runs if (Path(run) / "provenance.json").is_file()), None)
    return json.loads(path.read_text()) if path else {}


def main() -> None:
    parser = Parser(__doc__, prog="python scripts/plot_ablation.py")
    parser.add_argument("paths", nargs="+", help="sweep directories (with --replot: one folder of this script's CSVs)")
    parser.add_argument("--out", default=None, help="default: the first path")
    parser.add_argument("--replot", action="store_true", help="draw the plots again from the CSVs and the "
                        "provenance.json in the one path given (as written beside a checked-in ablation)")
    args = parser.parse_args()
    out = Path(args.out or args.paths[0])
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        folder = Path(args.paths[0])
        df = pd.read_csv(folder / "budget_vs_tokens_per_step.csv").assign(temperature=0.0)
        info = json.loads((folder / "provenance.json").read_text()) if (folder / "provenance.json").is_file() else {}
        print(f"wrote {plot_budget(df, out, info)}")
        return
    df = load(args.paths)
    info = run_provenance(df["run"])
    for path in (plot_budget(df, out, info), plot_sampling(df, out, info)):
        if path:
            print(f"wrote {path} and {path.with_suffix('.csv').name}")


if __name__ == "__main__":
    main()
