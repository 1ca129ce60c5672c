"""The leaderboard's plots (PNG, each with the CSV of the numbers drawn).

- speedup.png: speedup vs autoregressive per decoder, grouped by dataset.
- tokens_vs_flops.png: mean accepted tokens (decode tokens per step) vs decode FLOPs per step (target + draft, log x),
  one marker per decoder and dataset, plus the points of any sweeps given (the lookahead paper's
  compute-for-latency trade-off).
- acceptance_by_depth.png: for draft and head methods, the share of steps whose draft reached
  depth d that accepted it (for Medusa / BPD, depth d is head d-1's token); the summaries'
  acceptance_by_depth, pooled over datasets.
- accepted_by_output_position.png: every method's mean accepted tokens per decoding step against
  the step's position in the output, in bins (metrics.accepted_by_output_position), pooled over
  datasets: does acceptance hold up as answers grow long?
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from . import metrics
from .errors import BenchError


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speedup_plot(df: pd.DataFrame, datasets: list[str], labels: list[str], out: Path) -> None:
    data = df[df["dataset"].isin([*datasets, "all"])].pivot(index="decoder", columns="dataset", values="speedup")
    data = data.reindex(index=[x for x in labels if x in data.index],
                        columns=[d for d in [*datasets, "all"] if d in data.columns])
    data.to_csv(out / "speedup.csv")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(data)), 3.5))
    width = 0.8 / max(1, len(data.columns))
    x = np.arange(len(data))
    for j, ds in enumerate(data.columns):
        ax.bar(x + j * width, data[ds].to_numpy(), width, label=ds)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x + width * (len(data.columns) - 1) / 2, data.index, rotation=40, ha="right")
    ax.set_ylabel("speedup vs autoregressive\n(Spec-Bench: ratio of mean tokens/s)")
    # above the axes: inside, it hides the tallest bars
    ax.legend(fontsize=7, ncol=len(data.columns), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)


def sweep_points(sweeps: list[str]) -> pd.DataFrame:
    """Every run's summary.csv under the given directories (a run, a sweep, or a copy of summaries)."""
    rows = []
    for root in map(Path, sweeps):
        if not root.exists():
            raise BenchError(f"leaderboard.sweeps: {root} does not exist")
        for path in sorted(root.rglob("summary.csv")):
            for _, r in pd.read_csv(path).iterrows():
                if "mean_accepted_tokens" in r:
                    tokens, flops = r["mean_accepted_tokens"], r["decode_flops_per_step"]
                else:  # a summary written before the names were unified: its FLOPs were the target's only
                    draft = r.get("draft_flops_per_token", 0.0)
                    tokens = r["decode_tokens_per_step"]
                    flops = r["decode_flops_per_step"] + (0.0 if pd.isna(draft) else draft) * tokens
                rows.append({"decoder": r["decoder"], "dataset": r["dataset"], "source": str(path.parent),
                             "mean_accepted_tokens": tokens, "decode_flops_per_step": flops})
    return pd.DataFrame(rows)


def tokens_vs_flops_plot(df: pd.DataFrame, datasets: list[str], labels: list[str], sweeps: list[str],
                         out: Path) -> None:
    own = df[df["dataset"].isin(datasets)][["decoder", "dataset", "mean_accepted_tokens", "decode_flops_per_step"]]
    own = own.assign(source="leaderboard")
    extra = sweep_points(sweeps)
    data = pd.concat([own, extra], ignore_index=True) if len(extra) else own
    data.to_csv(out / "tokens_vs_flops.csv", index=False)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    cmap = plt.get_cmap("tab20")
    colours = {label: cmap(i % 20) for i, label in enumerate(labels)}
    markers = dict(zip(datasets, "osD^v"))
    for _, r in own.iterrows():
        ax.scatter(r["decode_flops_per_step"], r["mean_accepted_tokens"], color=colours[r["decoder"]],
                   marker=markers.get(r["dataset"], "o"), s=36, zorder=3)
    if len(extra):
        for name, group in extra.groupby("decoder"):
            base = next((c for label, c in colours.items() if label.split("-")[0] == name), "grey")
            ax.scatter(group["decode_flops_per_step"], group["mean_accepted_tokens"], color=base, alpha=0.35, s=14,
                       marker=".", label=f"{name} sweep")
    for label in labels:
        ax.scatter([], [], color=colours[label], label=label)
    for ds, m in markers.items():
        ax.scatter([], [], color="k", marker=m, label=ds)
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per decoding step (target + draft)")
    ax.set_ylabel("mean accepted tokens per decoding step")
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "tokens_vs_flops.png", dpi=110)
    plt.close(fig)


def acceptance_plot(records: dict, datasets: list[str], labels: list[str], out: Path) -> None:
    rows = []
    for label in labels:
        proposed, accepted = metrics.depth_totals(r for ds in datasets for r in records[ds, label])
        for d, (p, a) in enumerate(zip(proposed, accepted), start=1):
            if p:
                rows.append({"decoder": label, "depth": d, "proposed_steps": int(p), "accepted_steps": int(a),
                             "acceptance": a / p})
    data = pd.DataFrame(rows, columns=["decoder", "depth", "proposed_steps", "accepted_steps", "acceptance"])
    data.to_csv(out / "acceptance_by_depth.csv", index=False)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for label, group in data.groupby("decoder", sort=False):
        ax.plot(group["depth"], group["acceptance"], marker="o", label=label)
    ax.set_xlabel("draft depth (Medusa/BPD: head index + 1)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("accepted | drafted")
    ax.set_ylim(0, 1)
    if len(data):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_depth.png", dpi=110)
    plt.close(fig)


def position_bin(records) -> int:
    """A power-of-two bin of output positions giving at most 16 bins over the longest output (>= 8)."""
    longest = max((r.get("new_tokens") or 0 for r in records), default=0)
    return max(8, 2 ** math.ceil(math.log2(max(1, longest) / 16)))


def output_position_plot(records: dict, datasets: list[str], labels: list[str], out: Path) -> None:
    everything = [r for ds in datasets for label in labels for r in records[ds, label]]
    bin_tokens = position_bin(everything)
    parts = [metrics.accepted_by_output_position([r for ds in datasets for r in records[ds, label]], bin_tokens)
             .assign(decoder=label) for label in labels]
    data = pd.concat(parts, ignore_index=True)[["decoder", "position", "steps", "outputs", "mean_accepted_tokens"]]
    data.to_csv(out / "accepted_by_output_position.csv", index=False)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, group in data.groupby("decoder", sort=False):
        ax.plot(group["position"] + bin_tokens / 2, group["mean_accepted_tokens"], marker=".", label=label)
    ax.set_xlabel(f"position in the output (new tokens before the step; bins of {bin_tokens})")
    ax.set_ylabel("mean accepted tokens per decoding step")
    if len(data):
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "accepted_by_output_position.png", dpi=110)
    plt.close(fig)


def plot_all(out_dir: Path, datasets: list[str], labels: list[str], df: pd.DataFrame, sweeps: list[str],
             records: dict) -> Path:
    """records: (dataset, label) -> the entry's records, as the table was made from."""
    out = out_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    speedup_plot(df, datasets, labels, out)
    tokens_vs_flops_plot(df, datasets, labels, sweeps, out)
    acceptance_plot(records, datasets, labels, out)
    output_position_plot(records, datasets, labels, out)
    return out
