"""Every kind of figure the harness draws, rendered (matplotlib's Agg) from small checked-in runs, meets what a
reviewer asks of it (bench/plotting.py): the model, device and dtype in the title, a unit on every axis,
no two entries of a figure alike in colour and marker, an interval on every speedup, legends beside the
axes (never over the data) and no text over other text. Each check is shown to fail on a figure that
breaks it."""
from __future__ import annotations

import json
import shutil
from itertools import combinations

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgba
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure

from bench.plotting import pyplot
from helpers import REPO, script_module

REFERENCE = REPO / "results" / "reference"


@pytest.fixture
def drawn(monkeypatch):
    """The figures saved while the test runs, by file name."""
    figures, real = {}, Figure.savefig

    def recording(fig, path, *args, **kwargs):
        figures[str(path).split("/")[-1].lstrip(".").split(".tmp")[0]] = fig
        return real(fig, path, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", recording)
    return figures


def renderer(fig):
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def style_key(artist) -> tuple:
    """What tells an entry apart to a reader: its colour and its marker (a scatter's marker by its path)."""
    if isinstance(artist, PathCollection):
        colour = tuple(np.round(artist.get_facecolor()[0], 3)) if len(artist.get_facecolor()) else ()
        return colour, tuple(np.round(artist.get_paths()[0].vertices, 2).ravel()) if artist.get_paths() else ()
    return tuple(np.round(to_rgba(artist.get_color()), 3)), artist.get_marker()


def problems(fig, where: list[str], speedup: tuple[int, ...] = ()) -> list[str]:
    """What the figure breaks, one line each; `speedup`: the axes (by position) that draw speedups."""
    found = []
    r = renderer(fig)
    axes = [ax for ax in fig.axes if ax.has_data()]
    titles = [t.get_text() for t in [fig._suptitle] if t is not None] + [ax.get_title() for ax in axes]
    for text in where:
        if not any(text in t for t in titles):
            found.append(f"no title says {text!r}: {titles}")
    if not any(ax.get_ylabel() for ax in axes):
        found.append("no y label")
    for i, ax in enumerate(axes):
        for axis, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
            if label and not ("(" in label and ")" in label):
                found.append(f"{axis} label without a unit: {label!r}")
            if axis == "x" and not label:
                found.append("no x label")
        entries = {}
        for artist in [*ax.get_lines(), *ax.collections]:
            label = artist.get_label()
            if label and not label.startswith("_") and not label.endswith(" sweep"):
                entries.setdefault(label, style_key(artist))
        alike = [(a, b) for a, b in combinations(entries, 2) if entries[a] == entries[b]]
        if alike:
            found.append(f"entries alike in colour and marker: {alike}")
        legend = ax.get_legend()
        if legend is not None and legend.get_window_extent(r).overlaps(ax.get_window_extent(r)):
            found.append(f"the legend lies over the axes of {ax.get_title()!r}")
        for axis in (ax.xaxis, ax.yaxis):
            ticks = [t.get_window_extent(r) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            if any(a.overlaps(b) for a, b in combinations(ticks, 2)):
                found.append(f"tick labels overlap on {ax.get_title()!r}")
        notes = [t.get_window_extent(r) for t in ax.texts if t.get_visible()]
        if any(a.overlaps(b) for a, b in combinations(notes, 2)):
            found.append("point labels overlap")
        if i in speedup and not any(isinstance(c, ErrorbarContainer) for c in ax.containers):
            found.append("a speedup without its interval")
    heads = [t.get_window_extent(r) for t in [fig._suptitle, *(ax.title for ax in axes)]
             if t is not None and t.get_text()]
    if any(a.overlaps(b) for a, b in combinations(heads, 2)):
        found.append("titles overlap")
    return found


def test_the_checks_catch_a_figure_that_breaks_them():
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [1, 2], color="C0", marker="o", label="a")
    ax.plot([1, 2], [2, 3], color="C0", marker="o", label="b")
    ax.bar([1, 2], [1, 1.2], label="speedup")
    ax.legend(loc="upper left")
    for x in (1.0, 1.01):
        ax.annotate("W=16", (x, 2))
    ax.set(xlabel="batch size", title="no setup")
    found = problems(fig, ["AMD EPYC", "float32"], speedup=(0,))
    plt.close(fig)
    for expected in ("no title says 'AMD EPYC'", "no y label", "x label without a unit", "entries alike",
                     "the legend lies over the axes", "point labels overlap", "a speedup without its interval"):
        assert any(p.startswith(expected) for p in found), (expected, found)


LEADERBOARD = ["speedup.png", "tokens_vs_flops.png", "acceptance_by_depth.png", "accepted_by_output_position.png"]


@pytest.mark.slow  # a leaderboard's records read and tabled again: seconds
def test_the_leaderboards_plots(tmp_path, drawn):
    from bench.replot import replot

    replot(REFERENCE / "heads", tmp_path)
    assert sorted(drawn) == sorted(LEADERBOARD) and all((tmp_path / "plots" / f).stat().st_size for f in LEADERBOARD)
    where = ["smollm2-135m", "Intel(R) Xeon(R) Processor (1 thread)", "float32"]
    for name, fig in drawn.items():
        assert problems(fig, where, speedup=(0,) if name == "speedup.png" else ()) == [], name
    speedup = pd.read_csv(tmp_path / "plots" / "speedup.csv", header=[0, 1], index_col=0)
    assert {"speedup_ci_low", "speedup_ci_high"} <= set(speedup.columns.get_level_values(0))


def test_one_datasets_speedup_is_not_repeated_as_all(tmp_path, drawn):
    from bench.leaderboard_plots import speedup_plot

    df = pd.DataFrame({"decoder": ["autoregressive", "autoregressive", "x", "x"], "dataset": ["a", "all"] * 2,
                       "speedup": [1.0, 1.0, 1.5, 1.5], "speedup_ci_low": [1, 1, 1.2, 1.2],
                       "speedup_ci_high": [1, 1, 1.8, 1.8]})
    speedup_plot(df, ["a"], ["autoregressive", "x"], tmp_path, "m, cpu (2 threads), float32")
    bars = [t.get_text() for t in drawn["speedup.png"].axes[0].get_legend().get_texts()]
    assert bars == ["a"]
    assert problems(drawn["speedup.png"], ["float32"], speedup=(0,)) == []


def test_the_scaling_laws_plots(tmp_path, drawn):
    from bench import scaling

    sweep = shutil.copytree(REPO / "tests" / "fixtures" / "lookahead_sweep", tmp_path / "sweep")
    for run in sweep.iterdir():
        if run.is_dir():
            (run / "provenance.json").write_text(json.dumps({"device": "cpu", "device_name": "AMD EPYC",
                                                             "torch_threads": 2, "dtype": "bfloat16"}))
    scaling.write(scaling.analyse([sweep]), tmp_path / "out")
    assert sorted(drawn) == ["residuals.png", "steps_vs_flops.png", "tokens_per_s_vs_window.png"]
    for name, fig in drawn.items():
        assert problems(fig, ["AMD EPYC (2 threads)", "bfloat16"]) == [], name
    assert drawn["steps_vs_flops.png"].axes[0].texts  # the W labels that fit are drawn


def test_a_profile_plot(tmp_path, drawn):
    for name in ("profile.csv", "profile_provenance.json"):
        shutil.copy(REFERENCE / "gpu" / "2026-11-26-h100" / name, tmp_path / name)
    script_module("scripts/profile_device.py").replot(tmp_path)
    assert problems(drawn["profile.png"], ["NVIDIA H100 80GB HBM3", "float16", "random-vicuna-7b-shape"]) == []


def test_the_batch_speedup_plot(tmp_path, drawn):
    for name in ("batch_speedup.csv", "cost_curve.csv", "provenance.json"):
        shutil.copy(REFERENCE / "batching" / "packed" / name, tmp_path / name)
    script_module("scripts/batch_speedup.py").replot(tmp_path)
    assert problems(drawn["batch_speedup.png"], ["AMD EPYC (2 threads)", "float32"], speedup=(0,)) == []


def test_the_ablation_plots(tmp_path, drawn):
    ablation = script_module("scripts/plot_ablation.py")
    info = {"device": "cpu", "device_name": "AMD EPYC", "torch_threads": 1, "dtype": "float32"}
    budget = pd.read_csv(REFERENCE / "sequoia_ablation" / "budget_vs_tokens_per_step.csv").assign(temperature=0.0)
    ablation.plot_budget(budget, tmp_path, info)
    sampled = pd.DataFrame([{"decoder": d, "model": "m", "dataset": "gsm8k", "temperature": t, "top_p": p,
                             "tokens_per_step": 1 + t / 2, "acceptance_rate": 0.5, "run": "r"}
                            for d in ("spec_chain", "sequoia") for t in (0.0, 0.7, 1.0) for p in (0.9, 1.0)])
    ablation.plot_sampling(sampled, tmp_path, info)
    for name in ("budget_vs_tokens_per_step.png", "sampling_robustness.png"):
        assert problems(drawn[name], ["AMD EPYC (1 thread)", "float32"]) == [], name


def test_a_loss_curve(tmp_path, drawn):
    from bench.training.loss_curve import save_loss_curve

    weights = tmp_path / "heads.safetensors"
    weights.write_bytes(b"0")
    save_loss_curve(weights, {"head 0": [3.0, 2.0, 1.5], "head 1": [4.0, 3.0, 2.5]}, "KL(target || head)",
                    "m: Medusa heads", "m, AMD EPYC (2 threads), float32")
    assert problems(drawn["heads.png"], ["AMD EPYC (2 threads)", "float32"]) == []
