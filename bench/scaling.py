"""The scaling law of lookahead decoding from a W x N sweep (Fu et al. 2024): decoding steps
needed for T tokens against FLOPs per step, and tokens/s against W.

Each run directory gives W, N, G (config.yaml) and its totals (summary.csv, which the run
writes when it finishes). Steps for T tokens = T / tokens per decode step; the paper's law
is steps = a - b * ln(FLOPs per step): exponentially more compute per step buys linearly
fewer steps, and b is how many. Both per-step figures leave the prefill step out (its
prompt-sized forward would dominate short generations); summaries written before
bench.metrics had decode_* columns fall back to the figures with the prefill included.
A sweep over several datasets (or models) gives one law per (model, dataset): `analyse_each`.
Beside the fit: each point's residual from its N's line, the local slope between neighbouring
W (where the line bends), whether each output equals an autoregressive run's in the same paths,
and tokens/s, from the sweep or from a quieter throughput run given apart.
Used by scripts/scaling_law.py and notebooks/scaling_law.ipynb.
"""
from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from .plotting import entry_styles, label_points, legend_beside, save, setup, title
from .records import read_records, records_path, run_dirs

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
        unfinished = sorted(set(run_dirs(p)) - set(runs))
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


def with_residuals(points: pd.DataFrame, fits: pd.DataFrame) -> pd.DataFrame:
    """`residual`: each point's steps minus its own N's line (the per-N fits of `fit_table`)."""
    per_n = fits.set_index("N")
    law = [per_n.loc[str(n), "a"] - per_n.loc[str(n), "b"] * math.log(f)
           for n, f in zip(points["N"], points["flops_per_step"])]
    return points.assign(residual=points["steps"] - np.array(law, dtype=float))


def local_slopes(points: pd.DataFrame, fits: pd.DataFrame) -> pd.DataFrame:
    """Per N, between neighbouring W: steps saved per unit of ln(FLOPs per step), and the same as a
    share of that N's fitted b. A straight line keeps the share near 1; where it falls (well below
    1, say under 0.5) the line bends: more compute per step stops buying steps."""
    rows = []
    per_n = fits.set_index("N")
    for n, group in points.sort_values("W").groupby("N"):
        g = group.reset_index(drop=True)
        for i in range(1, len(g)):
            dx = math.log(g.loc[i, "flops_per_step"]) - math.log(g.loc[i - 1, "flops_per_step"])
            b = -(g.loc[i, "steps"] - g.loc[i - 1, "steps"]) / dx if dx else math.nan
            rows.append({"N": int(n), "W_from": int(g.loc[i - 1, "W"]), "W_to": int(g.loc[i, "W"]),
                         "b_local": b, "share_of_fit": _ratio(b, per_n.loc[str(n), "b"])})
    return pd.DataFrame(rows, columns=["N", "W_from", "W_to", "b_local", "share_of_fit"])


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def same_as_reference(points: pd.DataFrame, reference_run: str | None) -> pd.Series:
    """Per point, the share of its records whose tokens equal the reference (autoregressive) run's
    for the same prompt and turn; NaN without a reference or without records (summaries only)."""
    if reference_run is None or not records_path(reference_run).exists():
        return pd.Series(math.nan, index=points.index)
    ref = {r["key"]: r["tokens"] for r in read_records(records_path(reference_run)) if r.get("status") == "ok"}
    shares = []
    for run in points["run"]:
        path = records_path(run)
        pairs = [(r["tokens"], ref[r["key"]]) for r in (read_records(path) if path.exists() else [])
                 if r.get("status") == "ok" and r["key"] in ref]
        shares.append(float(np.mean([a == b for a, b in pairs])) if pairs else math.nan)
    return pd.Series(shares, index=points.index)


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


def _where(points: pd.DataFrame) -> str:
    """The dataset, model, device and dtype the points were measured on (the first run's provenance.json)."""
    path = Path(points["run"].iloc[0]) / "provenance.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    return f"{points['dataset'].iloc[0]}: {setup(info, points['model'].iloc[0])}"


def plot_steps_vs_flops(points: pd.DataFrame, fits: pd.DataFrame, tokens: int) -> Figure:
    fig = Figure(figsize=(6.8, 4.4), layout="constrained")
    ax = fig.subplots()
    styles = entry_styles(sorted(points["N"].unique()))
    for n, group in points.groupby("N"):
        ax.plot(group["flops_per_step"], group["steps"], label=f"N={n}", **styles[n])
    fit = fits.iloc[0]
    if not math.isnan(fit["b"]):
        x = np.geomspace(points["flops_per_step"].min(), points["flops_per_step"].max(), 50)
        ax.plot(x, fit["a"] - fit["b"] * np.log(x), "k--",
                label=f"steps = {fit['a']:.4g} - {fit['b']:.3g} ln(FLOPs)\n(R²={fit['r2']:.2f})")
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per decoding step (FLOPs, log scale)")
    ax.set_ylabel(f"decoding steps for {tokens} tokens (steps)")
    title(ax, "Lookahead's scaling law, G = W (point labels: W)", _where(points))
    legend_beside(ax, fontsize=8)
    label_points(ax, points["flops_per_step"], points["steps"], [f"W={w}" for w in points["W"]])
    return fig


def plot_tokens_per_s_vs_window(points: pd.DataFrame, baseline: float | None = None) -> Figure:
    """tokens/s against W, one line per N; `baseline`: autoregressive tokens/s, if measured."""
    fig = Figure(figsize=(6.8, 4.4), layout="constrained")
    ax = fig.subplots()
    styles = entry_styles(sorted(points["N"].unique()))
    for n, group in points.groupby("N"):
        ax.plot(group["W"].astype(int), group["tokens_per_s"], label=f"N={n}", **styles[n])
    if baseline is not None and not math.isnan(baseline):
        ax.axhline(baseline, color="k", linestyle=":", label="autoregressive")
    ax.set_xticks(sorted(points["W"].astype(int).unique()))
    ax.set_xlabel("W, the window (tokens; G = W)")
    ax.set_ylabel("throughput (tokens/s)")
    title(ax, "Lookahead's throughput", _where(points))
    legend_beside(ax, fontsize=8)
    return fig


@dataclass
class Analysis:
    runs: pd.DataFrame    # every finished run found
    points: pd.DataFrame  # the lookahead grid points (+ residual, same_as_autoregressive)
    fits: pd.DataFrame    # fit over all points, then per N
    tokens: int           # T
    baseline: float | None  # autoregressive tokens/s on the same model and dataset, if in the paths
    slopes: pd.DataFrame | None = None  # local_slopes: where the line bends
    throughput: pd.DataFrame | None = None  # points whose tokens/s are plotted (default: points)
    throughput_baseline: float | None = None

    @property
    def b(self) -> float:
        return float(self.fits.iloc[0]["b"])

    @property
    def setup(self) -> str:
        return _setup(self.points)

    @property
    def where(self) -> str:
        """The dataset, model, device and dtype: what the figures' titles say."""
        return _where(self.points)

    @property
    def dtype(self) -> str | None:
        """The runs' dtype (the first run's provenance.json), or None where it is not recorded."""
        path = Path(self.points["run"].iloc[0]) / "provenance.json"
        return json.loads(path.read_text()).get("dtype") if path.is_file() else None

    def figures(self) -> dict[str, Figure]:
        speed = self.points if self.throughput is None else self.throughput
        base = self.baseline if self.throughput is None else self.throughput_baseline
        return {"steps_vs_flops": plot_steps_vs_flops(self.points, self.fits, self.tokens),
                "residuals": plot_residuals(self.points),
                "tokens_per_s_vs_window": plot_tokens_per_s_vs_window(speed, base)}


def plot_residuals(points: pd.DataFrame) -> Figure:
    """Each point's distance from its own N's line: a law that holds leaves no pattern here."""
    fig = Figure(figsize=(6.8, 3.6), layout="constrained")
    ax = fig.subplots()
    fitted = points[points["residual"].notna()]  # an N with one W has no line
    styles = entry_styles(sorted(points["N"].unique()))
    for n, group in fitted.groupby("N"):
        ax.plot(group["flops_per_step"], group["residual"], label=f"N={n}", **styles[n])
    ax.axhline(0, color="k", linewidth=0.8)
    if not fitted.empty:
        ax.set_xscale("log")
        legend_beside(ax, fontsize=8)
    ax.set_xlabel("FLOPs per decoding step (FLOPs, log scale)")
    ax.set_ylabel("steps - its N's fit (steps)")
    title(ax, "Residuals from each N's line", _where(points))
    return fig


def _baseline(runs: pd.DataFrame, model: str, dataset: str) -> tuple[float | None, str | None]:
    same = (runs["decoder"] == "autoregressive") & (runs["model"] == model) & (runs["dataset"] == dataset)
    if not same.any():
        return None, None
    return float(runs.loc[same, "tokens_per_s"].mean()), runs.loc[same, "run"].iloc[0]


def _analysis(runs: pd.DataFrame, tokens: int | None, throughput: pd.DataFrame | None = None) -> Analysis:
    points, tokens = scaling_points(runs, tokens)
    model, dataset = points["model"].iloc[0], points["dataset"].iloc[0]
    baseline, reference = _baseline(runs, model, dataset)
    fits = fit_table(points)
    points = with_residuals(points, fits).assign(same_as_autoregressive=lambda p: same_as_reference(p, reference))
    speed = speed_base = None
    if throughput is not None:
        mine = throughput[(throughput["model"] == model) & (throughput["dataset"] == dataset)]
        if (mine["decoder"] == "lookahead").any():
            speed = scaling_points(mine, tokens)[0]
            speed_base = _baseline(mine, model, dataset)[0]
    return Analysis(runs, points, fits, tokens, baseline, local_slopes(points, fits), speed, speed_base)


def analyse(paths, tokens: int | None = None, throughput_paths=None) -> Analysis:
    """One law: the paths must hold one model and dataset (else `analyse_each`)."""
    throughput = load_runs(throughput_paths) if throughput_paths else None
    return _analysis(load_runs(paths), tokens, throughput)


def analyse_each(paths, tokens: int | None = None, throughput_paths=None) -> dict[str, Analysis]:
    """One law per (model, dataset) among the runs, keyed "model_dataset"."""
    runs = load_runs(paths)
    throughput = load_runs(throughput_paths) if throughput_paths else None
    out = {}
    for (model, dataset), group in runs.groupby(["model", "dataset"], sort=True):
        if (group["decoder"] == "lookahead").any():
            out[f"{model}_{dataset}"] = _analysis(group, tokens, throughput)
    if not out:
        scaling_points(runs, tokens)  # raises the one-line reason
    return out


def write(analysis: Analysis, out) -> list[Path]:
    """PNGs of both plots, the points (CSV) and the fits (CSV and Markdown) into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in analysis.figures().items():
        written.append(save(fig, out / f"{name}.png", dpi=120))
    analysis.points.to_csv(out / "scaling_points.csv", index=False)
    analysis.fits.to_csv(out / "scaling_fit.csv", index=False)
    if analysis.slopes is not None:
        analysis.slopes.to_csv(out / "local_slopes.csv", index=False)
        written.append(out / "local_slopes.csv")
    (out / "scaling_fit.md").write_text(
        f"steps for T = {analysis.tokens} tokens = a - b ln(FLOPs per step); {_setup(analysis.points)}\n\n"
        + analysis.fits.to_markdown(index=False, floatfmt=".4g") + "\n")
    return written + [out / "scaling_points.csv", out / "scaling_fit.csv", out / "scaling_fit.md"]
