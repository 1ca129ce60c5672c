"""The scaling law of lookahead decoding from a W x N sweep (Fu et al. 2024): decoding steps
needed for T tokens against FLOPs per step, and tokens/s against W.

Each run directory gives W, N, G (config.yaml) and its totals (summary.csv, which the run
writes when it finishes). Steps for T tokens = T / tokens per decode step; the paper's law
is steps = a - b * ln(FLOPs per step): exponentially more compute per step buys linearly
fewer steps, and b is how many. Both per-step figures leave the prefill step out (its
prompt-sized forward would dominate short generations); summaries written before
bench.metrics had decode_* columns fall back to the figures with the prefill included.
Used by scripts/scaling_law.py and notebooks/scaling_law.ipynb.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from omegaconf import OmegaConf

# Columns taken from each run's config.yaml.
CONFIG_KEYS = {"W": "decoder.window", "N": "decoder.ngram", "G": "decoder.guess_set_size",
               "max_new_tokens": "gen.max_new_tokens"}


def find_runs(paths) -> list[Path]:
    """Finished run directories (holding summary.csv) under the given run or sweep directories."""
    runs = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        runs += sorted({f.parent for f in p.rglob("summary.csv")})
        unfinished = sorted({f.parent for f in p.rglob("records.jsonl")} - set(runs))
        if unfinished:  # killed or still running: finish them with resume=true
            warnings.warn(f"left out {len(unfinished)} unfinished run(s) (no summary.csv yet), e.g. {unfinished[0]}")
    if not runs:
        raise FileNotFoundError(f"no finished runs (with summary.csv) under {' '.join(map(str, paths))}")
    return runs


def _int_or_none(value):
    # "auto" or a missing key (another decoder) is not a grid point.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_runs(paths) -> pd.DataFrame:
    """One row per run: its summary plus W, N, G and max_new_tokens from its config."""
    rows = []
    for run in find_runs(paths):
        config = OmegaConf.load(run / "config.yaml") if (run / "config.yaml").exists() else OmegaConf.create()
        summary = pd.read_csv(run / "summary.csv")
        for row in summary.to_dict("records"):
            row.update({k: _int_or_none(OmegaConf.select(config, key)) for k, key in CONFIG_KEYS.items()})
            row["run"] = str(run)
            rows.append(row)
    df = pd.DataFrame(rows)
    for k in CONFIG_KEYS:
        df[k] = df[k].astype("Int64")
    return df


def scaling_points(runs: pd.DataFrame, tokens: int | None = None) -> tuple[pd.DataFrame, int]:
    """The lookahead grid points, with steps needed for `tokens` (default: the runs' max_new_tokens)."""
    points = runs[(runs["decoder"] == "lookahead") & runs["W"].notna() & runs["N"].notna()
                  & (runs["tokens_per_step"] > 0)].copy()
    if points.empty:
        raise ValueError("no finished lookahead runs with integer decoder.window and decoder.ngram")
    setups = sorted(set(zip(points["model"], points["dataset"])))
    if len(setups) > 1:
        raise ValueError(f"one scaling law per model and dataset; these runs mix {setups}")
    tokens = int(tokens or points["max_new_tokens"].max())
    # Decode figures: mean_accepted_tokens (decode_tokens_per_step in older summaries), decode_flops_per_step.
    for col, names in (("tokens_per_step", ("mean_accepted_tokens", "decode_tokens_per_step")),
                       ("flops_per_step", ("decode_flops_per_step",))):
        decode = next((n for n in names if n in points and points[n].notna().all()), None)
        if decode:
            points[col] = points[decode]
    points["steps"] = tokens / points["tokens_per_step"]
    points = points.sort_values(["N", "W"]).reset_index(drop=True)
    return points[["W", "N", "G", "flops_per_step", "tokens_per_step", "steps", "tokens_per_s", "model",
                   "dataset", "run"]], tokens


def fit_law(flops, steps) -> dict:
    """Least squares steps = a - b * ln(flops); b_per_decade = steps saved per 10x FLOPs."""
    x, y = np.log(np.asarray(flops, dtype=float)), np.asarray(steps, dtype=float)
    if len(np.unique(x)) < 2:
        return {"a": math.nan, "b": math.nan, "b_per_decade": math.nan, "r2": math.nan, "points": len(x)}
    slope, a = np.polyfit(x, y, 1)
    residual = y - (a + slope * x)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1 - (residual ** 2).sum() / total if total > 0 else math.nan
    return {"a": a, "b": -slope, "b_per_decade": -slope * math.log(10), "r2": r2, "points": len(x)}


def fit_table(points: pd.DataFrame) -> pd.DataFrame:
    """The fit over all points, then one per N."""
    rows = [{"N": "all", **fit_law(points["flops_per_step"], points["steps"])}]
    for n, group in points.groupby("N"):
        rows.append({"N": str(n), **fit_law(group["flops_per_step"], group["steps"])})
    return pd.DataFrame(rows)


def _setup(points: pd.DataFrame) -> str:
    return f"{points['model'].iloc[0]} on {points['dataset'].iloc[0]}"


def plot_steps_vs_flops(points: pd.DataFrame, fits: pd.DataFrame, tokens: int) -> Figure:
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.subplots()
    for n, group in points.groupby("N"):
        ax.plot(group["flops_per_step"], group["steps"], marker="o", label=f"N={n}")
        for _, p in group.iterrows():
            ax.annotate(f"{p['W']}", (p["flops_per_step"], p["steps"]), fontsize=7, alpha=0.6,
                        xytext=(3, 3), textcoords="offset points")
    fit = fits.iloc[0]
    if not math.isnan(fit["b"]):
        x = np.geomspace(points["flops_per_step"].min(), points["flops_per_step"].max(), 50)
        ax.plot(x, fit["a"] - fit["b"] * np.log(x), "k--",
                label=f"steps = {fit['a']:.4g} - {fit['b']:.3g} ln(FLOPs)  (R²={fit['r2']:.2f})")
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per step (log scale)")
    ax.set_ylabel(f"decoding steps for {tokens} tokens")
    ax.set_title(f"Lookahead scaling law, G = W (labels: W); {_setup(points)}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def plot_tokens_per_s_vs_window(points: pd.DataFrame, baseline: float | None = None) -> Figure:
    """tokens/s against W, one line per N; `baseline`: autoregressive tokens/s, if measured."""
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.subplots()
    for n, group in points.groupby("N"):
        ax.plot(group["W"].astype(int), group["tokens_per_s"], marker="o", label=f"N={n}")
    if baseline is not None and not math.isnan(baseline):
        ax.axhline(baseline, color="k", linestyle=":", label="autoregressive")
    ax.set_xticks(sorted(points["W"].astype(int).unique()))
    ax.set_xlabel("W (window; G = W)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Lookahead throughput; {_setup(points)}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


@dataclass
class Analysis:
    runs: pd.DataFrame    # every finished run found
    points: pd.DataFrame  # the lookahead grid points
    fits: pd.DataFrame    # fit over all points, then per N
    tokens: int           # T
    baseline: float | None  # autoregressive tokens/s on the same model and dataset, if in the paths

    @property
    def b(self) -> float:
        return float(self.fits.iloc[0]["b"])

    def figures(self) -> dict[str, Figure]:
        return {"steps_vs_flops": plot_steps_vs_flops(self.points, self.fits, self.tokens),
                "tokens_per_s_vs_window": plot_tokens_per_s_vs_window(self.points, self.baseline)}


def analyse(paths, tokens: int | None = None) -> Analysis:
    runs = load_runs(paths)
    points, tokens = scaling_points(runs, tokens)
    same = (runs["decoder"] == "autoregressive") & (runs["model"] == points["model"].iloc[0]) \
        & (runs["dataset"] == points["dataset"].iloc[0])
    baseline = float(runs.loc[same, "tokens_per_s"].mean()) if same.any() else None
    return Analysis(runs, points, fit_table(points), tokens, baseline)


def write(analysis: Analysis, out) -> list[Path]:
    """PNGs of both plots, the points (CSV) and the fits (CSV and Markdown) into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in analysis.figures().items():
        fig.savefig(out / f"{name}.png", dpi=120)
        written.append(out / f"{name}.png")
    analysis.points.to_csv(out / "scaling_points.csv", index=False)
    analysis.fits.to_csv(out / "scaling_fit.csv", index=False)
    (out / "scaling_fit.md").write_text(
        f"steps for T = {analysis.tokens} tokens = a - b ln(FLOPs per step); {_setup(analysis.points)}\n\n"
        + analysis.fits.to_markdown(index=False, floatfmt=".4g") + "\n")
    return written + [out / "scaling_points.csv", out / "scaling_fit.csv", out / "scaling_fit.md"]
