"""A sharded leaderboard's finished units (bench/leaderboard_unit.py) merged into the files the
one-process run writes into leaderboard.out_dir: leaderboard.csv/.md, leaderboard_by_category,
spec_bench.csv/.md, tuning.csv, plots/, verification_cost.csv (a row per node), provenance.json and
leaderboard.yaml.

Speedups never cross a node: an entry's records are paired, question by question, with the
reference's records of its own unit, timed beside it on the same node (each record names its node,
and a pair from two nodes is refused), and the tables aggregate those pairs as the one-process run
aggregates its own (bench/leaderboard_tables.py, bench/spec_bench_table.py: Spec-Bench's mean
tokens/s over the reference's). A node twice as slow halves both sides of its pairs, so no ratio
moves; a slower node's questions only weigh less in the means, as a slower question's do on one
node. The table's autoregressive row is the first group of entries' units' reference.

Refused in one line, nothing written: a unit not finished, a unit whose run settings are not the
plan's, or units whose commit, tree or model differ.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from . import rundir
from .errors import BenchError
from .leaderboard_plan import Unit, reference_units
from .leaderboard_tables import markdown, tuned_choice, write_tables
from .leaderboard_unit import KEY, Plan, differs, finished, load_plan, read_provenance, unit_dir
from .records import read_records, records_path
from .registry import REFERENCE
from .runner import build, sampling_from

PAIRED = "each prompt's pair timed in one unit, on one node"


def check_units(plan: Plan, out_dir: Path) -> dict[str, dict]:
    """Every unit finished, its run settings the plan's, and one build across them; returns each
    unit's provenance."""
    waiting = [u.name for u in plan.units if not finished(out_dir, u)]
    if waiting:
        raise BenchError(f"{len(waiting)} of {len(plan.units)} units in {Path(out_dir) / 'units'} are not finished "
                         f"({', '.join(waiting[:4])}{', ...' if len(waiting) > 4 else ''}); rerun the command that "
                         "planned them to run what is missing")
    infos = {}
    for u in plan.units:
        where = unit_dir(out_dir, u)
        for label in u.labels:
            run = where / u.dataset / label
            found = rundir.recorded_config(run, KEY)
            diff = rundir.config_difference(found[1], plan.runs[u.dataset, label], ignore=("leaderboard",)) \
                if found else "no config.yaml"
            if diff:
                raise BenchError(f"{run} was run with other settings than the plan's ({diff}); it cannot be merged: "
                                 "remove the unit's directory and rerun the command to run it again")
        infos[u.name] = read_provenance(where)
    first = plan.units[0].name
    for name, info in infos.items():
        why = differs(infos[first], info)
        if why:
            raise BenchError(f"units {first} and {name} were run with different builds ({why}); a table merges one "
                             "commit and one model: rerun the odd units (remove their directories) with the others'")
    return infos


def unit_records(plan: Plan, out_dir: Path, unit: Unit, prompts: list) -> dict[str, list[dict]]:
    """label -> the unit's records, in the order the one-process run keeps them (prompt, then turn)."""
    turns = plan.base.leaderboard.get("turns", "first")
    keys = [f"{p.id}#{t}" for p in prompts[unit.start:unit.stop]
            for t in (range(len(p.turns)) if turns == "all" else [0])]
    out = {}
    for label in unit.labels:
        by_key = {r["key"]: r for r in read_records(records_path(unit_dir(out_dir, unit) / unit.dataset / label))}
        out[label] = [by_key[k] for k in keys if k in by_key]
    return out


def check_nodes(unit: Unit, records: dict[str, list[dict]]) -> None:
    """Each entry's record and the reference's it is paired with were timed on one node."""
    reference = {r["key"]: r.get("node") for r in records[REFERENCE]}
    for label, recs in records.items():
        for r in recs:
            there = reference.get(r["key"])
            if r.get("node") and there and r["node"] != there:
                raise BenchError(f"unit {unit.name}: {label}'s {r['key']} ran on {r['node']}, the reference's on "
                                 f"{there}; a speedup must not cross nodes: remove the unit's directory and rerun")


def gather(plan: Plan, out_dir: Path) -> tuple[dict, dict]:
    """(records, references): (dataset, label) -> the entry's records over every unit, in question
    order, and the reference's records each was paired with (its own unit's)."""
    records: dict = {}
    references: dict = {}
    reference_from = {u.name for group in reference_units(plan.units).values() for u in group}
    for ds in plan.base.leaderboard.datasets:
        prompts = build(plan.runs[ds, REFERENCE].dataset, "dataset").load()
        for label in plan.labels:
            records[ds, label], references[ds, label] = [], []
        for u in sorted((u for u in plan.units if u.dataset == ds), key=lambda u: u.start):
            got = unit_records(plan, out_dir, u, prompts)
            check_nodes(u, got)
            for label in u.labels[1:]:
                records[ds, label] += got[label]
                references[ds, label] += got[REFERENCE]
            if u.name in reference_from:
                records[ds, REFERENCE] += got[REFERENCE]
                references[ds, REFERENCE] += got[REFERENCE]
    return records, references


def node_costs(plan: Plan, out_dir: Path, infos: dict[str, dict]) -> dict[str, pd.DataFrame]:
    """Each node's verification cost, as its first unit there measured it."""
    costs: dict[str, pd.DataFrame] = {}
    for u in plan.units:
        node = infos[u.name]["attempts"][-1]["node"]
        csv = unit_dir(out_dir, u) / "verification_cost.csv"
        if node not in costs and csv.is_file():
            costs[node] = pd.read_csv(csv)
    return costs


def setup(infos: dict[str, dict]) -> dict:
    """leaderboard.md's machine line over the units: each value once."""
    def values(key):
        return " / ".join(dict.fromkeys(str(i.get(key)) for i in infos.values()))
    nodes = dict.fromkeys(a["node"] for i in infos.values() for a in i.get("attempts", []))
    return {"nodes": f"{len(nodes)} ({', '.join(nodes)})", "device": values("device_name"), "dtype": values("dtype"),
            "fast path": values("fast_path"), "threads": values("torch_threads")}


def tuning_notes(records: dict) -> str:
    """Entries whose auto-tuning chose differently in different units (each tunes on its own node)."""
    notes = []
    for (ds, label), recs in records.items():
        choices = list(dict.fromkeys(tuned_choice(r["tuned"]) for r in recs if r.get("tuned")))
        if len(choices) > 1:
            notes.append(f"\n{label} on {ds} tuned itself differently in its units (each on its node): "
                         f"{' / '.join(choices)}; its figures pool them\n")
    return "".join(notes)


def merge(out_dir: Path) -> str:
    """Writes the merged tables, plots and provenance into out_dir; returns leaderboard.md's text."""
    out_dir = Path(out_dir)
    plan = load_plan(out_dir)
    infos = check_units(plan, out_dir)
    records, references = gather(plan, out_dir)
    board, datasets, labels = plan.base.leaderboard, list(plan.base.leaderboard.datasets), plan.labels
    greedy = sampling_from(plan.runs[datasets[0], REFERENCE]).greedy
    df = write_tables(out_dir, records, datasets, labels, greedy=greedy, references=references)
    from .leaderboard_plots import plot_all

    costs = node_costs(plan, out_dir, infos)
    by_node = pd.concat([cost.assign(node=node) for node, cost in costs.items()])
    rundir.write_atomic(out_dir / "verification_cost.csv", by_node.to_csv(index=False))
    plot_all(out_dir, datasets, labels, df, list(board.sweeps), records)
    first = next(iter(infos.values()))
    info = {**{k: v for k, v in first.items() if k not in ("unit", "attempts", "node")},
            "leaderboard": {"overrides": plan.overrides, "labels": labels, "datasets": datasets, "limit": board.limit,
                            "repeats": board.repeats, "turns": board.get("turns", "first"),
                            "cluster": {k: v for k, v in board.cluster.items() if k != "unit"}},
            "units": {name: {"unit": i["unit"], "attempts": i["attempts"]} for name, i in infos.items()}}
    rundir.write_atomic(out_dir / "provenance.json", json.dumps(info, indent=2))
    rundir.write_atomic(out_dir / "leaderboard.yaml", OmegaConf.to_yaml(plan.base, resolve=True))
    md = markdown(df, {f"node {node}": cost for node, cost in costs.items()}, plan.base, setup(infos), paired=PAIRED)
    md += tuning_notes(records)
    rundir.write_atomic(out_dir / "leaderboard.md", md)
    return md
