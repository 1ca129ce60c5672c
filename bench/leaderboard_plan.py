"""A sharded leaderboard's plan (bench/leaderboard_cluster.py submits it): its units of work, what each
is expected to generate and cost, and whether it fits a node, all known before anything is submitted.

A unit is (entries, a slice of a dataset's questions): leaderboard.cluster.entries entries, in table
order, run beside the autoregressive reference on leaderboard.cluster.questions consecutive questions
(every turn of each), as the one-process run runs them (bench/leaderboard_run.py). The reference is
timed in every unit, on the unit's node, so that every speedup divides two times taken on one node.
An entry that carries state between prompts (recycling's hot table, suffix's trie:
decoders.core.contract.CarriesState) gets a dataset's questions in one unit, as in the one-process
run, so that it drafts from what the same earlier prompts left.

Expected figures per unit and entry: tokens, the turns' budget (gen.max_new_tokens), or a pilot's
mean tokens a turn (leaderboard.cluster.pilot: an earlier leaderboard of this model, on any device:
what a step saves does not depend on it); target forwards, one a token for the reference and, with a
pilot, tokens / its tokens per step (else at most one a token); seconds, with a device profile of the
node (leaderboard.cluster.profile, as bench/forecast.py reads it): the pilot's steps priced there, or
without a pilot one-token steps (entries then at most as many as the reference's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig

from decoders.core.contract import CarriesState, widest_step
from decoders.core.weights_file import addon_bytes

from . import metrics, rundir
from .errors import BenchError
from .forecast import forecast, load_profile, load_run, pick_path
from .models import GiB, free_bytes, resolve_device
from .records import read_records, records_path
from .registry import REFERENCE
from .runner import build, check_config

LOCAL = ("joblib", "basic", "submitit_local")  # launchers that run the units on this machine


@dataclass(frozen=True)
class Unit:
    name: str  # its directory under <out_dir>/units/
    dataset: str
    labels: tuple[str, ...]  # the reference first
    start: int  # questions [start, stop) of the dataset's (after dataset.limit)
    stop: int
    turns: int  # turns each label runs: the questions' turns (leaderboard.turns=all) or one each

    def as_dict(self) -> dict:
        return {"name": self.name, "dataset": self.dataset, "labels": list(self.labels), "start": self.start,
                "stop": self.stop, "turns": self.turns}


def check_cluster(board) -> None:
    """leaderboard.cluster's sizes, one line for a bad one."""
    cluster = board.cluster
    for key in ("questions", "entries"):
        value = cluster.get(key)
        if value is None and key == "questions":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            allowed = "an integer >= 1 or null (all of a dataset's)" if key == "questions" else "an integer >= 1"
            raise BenchError(f"leaderboard.cluster.{key} must be {allowed}, got {value!r}")
    memory = cluster.get("memory_gb")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0):
        raise BenchError(f"leaderboard.cluster.memory_gb must be a number > 0 (GiB) or null, got {memory!r}")
    for key in ("profile", "pilot"):
        path = cluster.get(key)
        if path is not None and not Path(str(path)).exists():
            what = ("a scripts/profile_device.py --out directory or a roofline file" if key == "profile"
                    else "an earlier leaderboard's out_dir")
            raise BenchError(f"leaderboard.cluster.{key}={path} does not exist; give {what}, or null")


def make_units(base: DictConfig, labels: list[str], runs: dict, whole: bool = False) -> list[Unit]:
    """The board's units, dataset by dataset, in table order: each group of entries over its slices
    (whole: the one-process run's, a dataset and every entry a unit)."""
    check_cluster(base.leaderboard)
    board, cluster = base.leaderboard, base.leaderboard.cluster
    entries = [label for label in labels if label != REFERENCE]
    units = []
    for ds in board.datasets:
        prompts = build(runs[ds, REFERENCE].dataset, "dataset").load()
        turns = [len(p.turns) if board.get("turns", "first") == "all" else 1 for p in prompts]
        if whole:
            units.append(Unit(ds, ds, (REFERENCE, *entries), 0, len(prompts), sum(turns)))
            continue
        carries = [label for label in entries if isinstance(check_config(runs[ds, label])[1], CarriesState)]
        split = [label for label in entries if label not in carries]
        step = cluster.questions or len(prompts)
        for group_of, size in ((split, step), (carries, len(prompts))):
            groups = [group_of[i:i + cluster.entries] for i in range(0, len(group_of), cluster.entries)]
            if not entries and group_of is split:
                groups = [[]]  # a board of the reference alone
            for group in groups:
                for start in range(0, len(prompts), size):
                    stop = min(start + size, len(prompts))
                    name = f"{ds}.{'+'.join(group) or REFERENCE}.q{start}-{stop - 1}"
                    units.append(Unit(name, ds, (REFERENCE, *group), start, stop, sum(turns[start:stop])))
    return units


def reference_units(units: list[Unit]) -> dict[str, list[Unit]]:
    """Per dataset, the units whose reference records make the table's autoregressive row: the first
    group's (they cover every question once)."""
    first: dict[str, tuple] = {}
    for u in units:
        first.setdefault(u.dataset, u.labels)
    return {ds: [u for u in units if u.dataset == ds and u.labels == group] for ds, group in first.items()}


@dataclass
class Node:
    """What a unit's job gets: its device, the memory it may take and where that figure comes from."""
    device: torch.device
    memory: float  # bytes; inf where unknown
    source: str


def node_of(base: DictConfig, launcher: DictConfig, choice: str) -> Node:
    """The node a job runs on, from the launcher's settings (GPUs asked for or not, mem_gb) and
    leaderboard.cluster.memory_gb."""
    given = base.leaderboard.cluster.get("memory_gb")
    if choice in LOCAL:
        device = resolve_device(base.device)
        if given:
            return Node(device, given * GiB, "leaderboard.cluster.memory_gb")
        return Node(device, free_bytes(device) or math.inf, "this machine's free memory")
    gpus = launcher.get("gpus_per_node") or launcher.get("gpus_per_task") or 0
    device = torch.device("cuda" if base.device == "auto" and gpus else "cpu" if base.device == "auto" else
                          base.device)
    if given:
        return Node(device, given * GiB, "leaderboard.cluster.memory_gb")
    if device.type == "cpu" and launcher.get("mem_gb"):
        return Node(device, launcher.mem_gb * GiB, "hydra.launcher.mem_gb")
    return Node(device, math.inf, "unchecked: give leaderboard.cluster.memory_gb, a GPU's memory")


def check_fit(units: list[Unit], runs: dict, node: Node) -> dict[str, float]:
    """Each unit's memory estimate (bytes) on the node: the target beside its entries' add-ons and
    their widest step, as the unit's job will load it (bench/leaderboard_run.py, load_target); one line
    for a unit that would not fit."""
    decoders = {key: check_config(cfg)[1] for key, cfg in runs.items()}
    addons = {key: addon_bytes(d) for key, d in decoders.items()}
    specs = {ds: build(runs[ds, REFERENCE].model, "model") for ds, _ in runs}
    need = {}
    for u in units:
        keys = [(u.dataset, label) for label in u.labels]
        try:
            estimate = specs[u.dataset].fit(add_ons=sum(addons[k] for k in keys),
                                            step=max(widest_step(decoders[k]) for k in keys),
                                            on=(node.device, node.memory))
        except BenchError as e:
            raise BenchError(f"leaderboard.cluster: unit {u.name} would not fit a node ({node.device.type}, "
                             f"{node.memory / GiB:.1f} GiB from {node.source}): {e}") from None
        need[u.name] = sum(estimate.values()) if estimate else math.nan
    return need


def pilot_figures(pilot: Path | None, profile, runs: dict) -> dict:
    """(dataset, label) -> the pilot's tokens a turn, tokens per step and, with a profile, forecast
    tokens/s on it (bench/forecast.py), where the pilot ran that entry on that dataset."""
    figures = {}
    for (ds, label), cfg in runs.items():
        run_dir = Path(pilot) / ds / label if pilot else None
        if run_dir is None or not records_path(run_dir).is_file():
            continue
        found = rundir.recorded_config(run_dir, "leaderboard.cluster.pilot")
        if found is None or found[1].model.name != cfg.model.name:
            raise BenchError(f"leaderboard.cluster.pilot={pilot}: {run_dir} ran model "
                             f"{found[1].model.name if found else 'unknown (no config.yaml)'}, not {cfg.model.name}; "
                             "give an earlier leaderboard of this model")
        ok = [r for r in read_records(records_path(run_dir)) if r["status"] == "ok"]
        if not ok:
            continue
        figures[ds, label] = {"tokens_a_turn": sum(r["new_tokens"] for r in ok) / len(ok),
                              "tokens_per_step": metrics.tokens_per_step(ok)}
        if profile is not None:
            run = load_run(run_dir)
            if run.records:
                figures[ds, label]["tokens_per_s"] = float(forecast([run], profile)["forecast_tokens_per_s"].iloc[0])
    return figures


def one_token_ms(profile, context: float, fast_path: str) -> float:
    """The profile's autoregressive step after `context` tokens on model.fast_path's curve (auto: the
    fastest, as auto chooses); NaN for a roofline, which prices a model by its FLOPs spec, which only a
    run's provenance holds."""
    if profile.roofline is not None or not profile.curves:
        return math.nan
    if fast_path == "auto":
        return min(curve.forward_ms(1, context) for curve in profile.curves.values())
    try:
        path = pick_path(profile.curves, {"fast_path": fast_path}, None, profile.source)
    except BenchError:
        raise BenchError(f"leaderboard.cluster.profile={profile.source} profiles {', '.join(profile.curves)}, not "
                         f"model.fast_path={fast_path}: give a profile of it, or set model.fast_path") from None
    return profile.curves[path].forward_ms(1, context)


def expected(units: list[Unit], base: DictConfig, runs: dict) -> pd.DataFrame:
    """A row per (unit, label): runs, tokens, forwards (forwards_bound: at most), seconds (NaN without a
    profile)."""
    cluster, repeats = base.leaderboard.cluster, base.leaderboard.repeats
    profile = load_profile(Path(str(cluster.profile))) if cluster.get("profile") else None
    pilot = pilot_figures(Path(str(cluster.pilot)) if cluster.get("pilot") else None, profile, runs)
    first = runs[next(iter(runs))]
    step_ms = one_token_ms(profile, first.gen.max_new_tokens / 2, first.model.fast_path) if profile else None
    rows = []
    for u in units:
        budget = runs[u.dataset, REFERENCE].gen.max_new_tokens
        for label in u.labels:
            got = pilot.get((u.dataset, label), {})
            runs_here = u.turns * repeats
            tokens = runs_here * min(got.get("tokens_a_turn", budget), budget)
            per_step = got.get("tokens_per_step", 1.0 if label == REFERENCE else math.nan)
            forwards = tokens / per_step if not math.isnan(per_step) else tokens
            if "tokens_per_s" in got:
                seconds = tokens / got["tokens_per_s"]
            elif step_ms is not None:  # at mid-answer (the prompts' lengths are not known here)
                seconds = forwards * step_ms / 1e3
            else:
                seconds = math.nan
            rows.append({"unit": u.name, "label": label, "runs": runs_here, "tokens": tokens, "forwards": forwards,
                         "forwards_bound": math.isnan(per_step), "seconds": seconds})
    return pd.DataFrame(rows)


def describe(units: list[Unit], table: pd.DataFrame, need: dict[str, float], node: Node, base: DictConfig,
             launcher: str | None) -> str:
    """The plan as printed: a row per unit, then the totals beside the one-process run's (launcher
    None: the plan of the one-process run itself)."""
    cluster = base.leaderboard.cluster
    rows = []
    for u in units:
        part = table[table["unit"] == u.name]
        bound = "<=" if part["forwards_bound"].any() else ""
        rows.append({"unit": u.name, "questions": f"{u.start}-{u.stop - 1}", "turns": u.turns,
                     "labels": " ".join(u.labels), "tokens": int(part["tokens"].sum()),
                     "forwards": f"{bound}{int(part['forwards'].sum())}",
                     "hours": part["seconds"].sum(min_count=len(part)) / 3600,
                     "memory_gib": need.get(u.name, math.nan) / GiB})
    # the one-process run times the reference once a question, not once a unit
    first = {u.name for group in reference_units(units).values() for u in group}
    is_reference = table["label"] == REFERENCE
    single = table[~is_reference | table["unit"].isin(first)]["seconds"].sum(min_count=1)
    total = table["seconds"].sum(min_count=len(table))
    estimated = not math.isnan(total)
    how = (f"{len(units)} units on hydra/launcher={launcher} (leaderboard.cluster.questions={cluster.questions}, "
           f"entries={cluster.entries}), each timing the {REFERENCE} reference on its node" if launcher else
           "the one-process run, a unit a dataset")
    lines = [f"plan: {how}; memory {node.memory / GiB:.1f} GiB ({node.source}), device {node.device.type}",
             pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3g"),
             f"total: {int(table['tokens'].sum())} tokens, "
             + (f"{total / 3600:.3g} node-hours" + (f" (the one-process run: {single / 3600:.3g})" if launcher else "")
                + ", model loads and queueing not counted" if estimated else
                "no time estimate: give leaderboard.cluster.profile (a device profile of the node)")
             + ("" if cluster.get("pilot") else "; tokens are the budget (gen.max_new_tokens a turn): "
                "leaderboard.cluster.pilot=<an earlier leaderboard> gives expected ones")]
    return "\n\n".join(lines)
