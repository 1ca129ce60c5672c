"""The leaderboard's plots (PNG, each with the CSV of the numbers drawn), every title saying the model,
device and dtype they were measured on (bench/plotting.py's conventions).

- speedup.png: speedup vs autoregressive per decoder and dataset (and over all datasets where there are
  several), with its 95% interval.
- tokens_vs_flops.png: mean accepted tokens (decode tokens per step) vs decode FLOPs per step (target +
  draft, log x), a panel per dataset, a marker per decoder, plus the points of any sweeps given (the
  lookahead paper's compute-for-latency trade-off).
- acceptance_by_depth.png: for draft and head methods, the share of steps whose draft reached
  depth d that accepted it (for Medusa / BPD, depth d is head d-1's token); the summaries'
  acceptance_by_depth, pooled over datasets.
- accepted_by_output_position.png: every method's mean accepted tokens per decoding step against
  the step's position in the output, in at most 8 bins (metrics.accepted_by_output_position), pooled
  over datasets, each bin drawn where at least 3 outputs reach it: does acceptance hold up as answers
  grow long?
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from . import metrics
from .errors import BenchError
from .plotting import entry_styles, interval, legend_beside, pyplot, save, title

MIN_OUTPUTS = 3  # a position bin fewer outputs reach is noise, not a trend: left out of the plot (kept in the CSV)


def speedup_plot(df: pd.DataFrame, datasets: list[str], labels: list[str], out: Path, where: str = "") -> None:
    shown = [*datasets, "all"] if len(datasets) > 1 else list(datasets)  # "all" of one dataset repeats it
    rows = df[df["dataset"].isin(shown)]
    columns = [c for c in ("speedup", "speedup_ci_low", "speedup_ci_high") if c in rows]
    data = rows.pivot(index="decoder", columns="dataset", values=columns)
    order = [x for x in labels if x in data.index]
    sets = [d for d in shown if d in data["speedup"].columns]
    data = data.reindex(index=order)
    data.to_csv(out / "speedup.csv")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 1.2 + 0.16 * len(order) * max(1, len(sets))), layout="constrained")
    height = 0.8 / max(1, len(sets))
    y = np.arange(len(order))
    colours = entry_styles(sets)
    for j, ds in enumerate(sets):
        value = data["speedup"][ds].to_numpy(float)
        errors = (interval(value, data["speedup_ci_low"][ds], data["speedup_ci_high"][ds])
                  if "speedup_ci_low" in data else None)
        ax.barh(y + j * height, value, height, xerr=errors, color=colours[ds]["color"], label=ds,
                error_kw={"elinewidth": 0.8, "capsize": 2})
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(y + height * (len(sets) - 1) / 2, order)
    ax.invert_yaxis()  # the table's order, top down
    ax.set_xlabel("speedup over autoregressive (x; Spec-Bench's: ratio of mean tokens/s)")
    ax.set_ylabel("decoder (leaderboard entry)")
    title(ax, "Speedup with its 95% interval", where)
    legend_beside(ax, title="dataset")
    save(fig, out / "speedup.png")


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
                         out: Path, where: str = "") -> None:
    own = df[df["dataset"].isin(datasets)][["decoder", "dataset", "mean_accepted_tokens", "decode_flops_per_step"]]
    own = own.assign(source="leaderboard")
    extra = sweep_points(sweeps)
    data = pd.concat([own, extra], ignore_index=True) if len(extra) else own
    data.to_csv(out / "tokens_vs_flops.csv", index=False)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(datasets), figsize=(3.2 * len(datasets) + 0.6, 3.8), sharey=True, squeeze=False,
                             layout="constrained")
    styles = entry_styles(labels)
    for ax, ds in zip(axes[0], datasets):
        for _, r in own[own["dataset"] == ds].iterrows():
            ax.scatter(r["decode_flops_per_step"], r["mean_accepted_tokens"], s=30, zorder=3, **styles[r["decoder"]],
                       label=r["decoder"])
        mine = extra[extra["dataset"] == ds] if len(extra) else extra
        for name, group in (mine.groupby("decoder") if len(mine) else ()):
            ax.scatter(group["decode_flops_per_step"], group["mean_accepted_tokens"], color="grey", alpha=0.4, s=10,
                       marker=".", label=f"{name} sweep")
        ax.set_xscale("log")
        ax.set_title(ds, fontsize=8)
        ax.set_xlabel("decode FLOPs per step,\ntarget + draft (FLOPs, log)")
    axes[0][0].set_ylabel("mean accepted tokens per\ndecoding step (tokens)")
    fig.suptitle(f"Tokens per step against compute per step\n{where}", fontsize=8)
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    axes[0][-1].legend(handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False,
                       fontsize=6, borderaxespad=0.0)
    save(fig, out / "tokens_vs_flops.png")


def acceptance_plot(records: dict, datasets: list[str], labels: list[str], out: Path, where: str = "") -> None:
    rows = []
    for label in labels:
        proposed, accepted = metrics.depth_totals(r for ds in datasets for r in records[ds, label])
        for d, (p, a) in enumerate(zip(proposed, accepted), start=1):
            if p:
                rows.append({"decoder": label, "depth": d, "proposed_steps": int(p), "accepted_steps": int(a),
                             "acceptance": a / p})
    data = pd.DataFrame(rows, columns=["decoder", "depth", "proposed_steps", "accepted_steps", "acceptance"])
    data.to_csv(out / "acceptance_by_depth.csv", index=False)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5), layout="constrained")
    styles = entry_styles(labels)
    for label, group in data.groupby("decoder", sort=False):
        ax.plot(group["depth"], group["acceptance"], label=label, **styles[label])
    ax.set_xlabel("draft depth d (tokens after the root; Medusa/BPD: head d-1)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("accepted / drafted at depth d (share)")
    ax.set_ylim(0, 1.05)
    title(ax, "Acceptance by draft depth, pooled over datasets", where)
    legend_beside(ax)
    save(fig, out / "acceptance_by_depth.png")


def position_bin(records) -> int:
    """A power-of-two bin of output positions giving at most 8 bins over the longest output (>= 8)."""
    longest = max((r.get("new_tokens") or 0 for r in records), default=0)
    return max(8, 2 ** math.ceil(math.log2(max(1, longest) / 8)))


def output_position_plot(records: dict, datasets: list[str], labels: list[str], out: Path, where: str = "") -> None:
    everything = [r for ds in datasets for label in labels for r in records[ds, label]]
    bin_tokens = position_bin(everything)
    parts = [metrics.accepted_by_output_position([r for ds in datasets for r in records[ds, label]], bin_tokens)
             .assign(decoder=label) for label in labels]
    data = pd.concat(parts, ignore_index=True)[["decoder", "position", "steps", "outputs", "mean_accepted_tokens"]]
    data.to_csv(out / "accepted_by_output_position.csv", index=False)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4), layout="constrained")
    styles = entry_styles(labels)
    shown = data[data["outputs"] >= MIN_OUTPUTS]
    for label, group in shown.groupby("decoder", sort=False):
        ax.plot(group["position"] + bin_tokens / 2, group["mean_accepted_tokens"], label=label, ms=4, **styles[label])
    ax.set_xlabel(f"position in the output (tokens; bins of {bin_tokens}, drawn at their centres)")
    ax.set_ylabel("mean accepted tokens per decoding step (tokens)")
    title(ax, f"Acceptance along the output (bins reached by {MIN_OUTPUTS}+ outputs), pooled over datasets", where)
    legend_beside(ax)
    save(fig, out / "accepted_by_output_position.png")


def plot_all(out_dir: Path, datasets: list[str], labels: list[str], df: pd.DataFrame, sweeps: list[str],
             records: dict, where: str = "") -> Path:
    """records: (dataset, label) -> the entry's records, as the table was made from; `where`: the model,
    device and dtype, for the titles (plotting.setup)."""
    out = out_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    speedup_plot(df, datasets, labels, out, where)
    tokens_vs_flops_plot(df, datasets, labels, sweeps, out, where)
    acceptance_plot(records, datasets, labels, out, where)
    output_position_plot(records, datasets, labels, out, where)
    return out
