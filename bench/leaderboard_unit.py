"""One unit of a sharded leaderboard (bench/leaderboard_plan.py), in its own job: its entries and the
autoregressive reference on its slice of questions, run as the one-process run runs a dataset
(bench/leaderboard_run.py, run_dataset) into <out_dir>/units/<unit>/, a leaderboard directory of its
own that the same job resumes. The target is loaded with the unit's entries' add-ons only.

provenance.json says what the unit ran on, attempt by attempt (node, device, SLURM job): a unit
stopped and resumed elsewhere keeps each prompt's records from one node (they are written together),
and is refused to resume at another commit, tree or model than it started with. unit.json, written
last, marks the unit finished; bench/leaderboard_merge.py reads only finished units.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from . import provenance, rundir
from .__main__ import check_devices, error_reason
from .errors import BenchError
from .leaderboard_plan import Unit
from .leaderboard_run import load_target, run_dataset, verification_cost
from .leaderboard_tables import write_summaries
from .registry import REFERENCE
from .slurm import Stopped

PLAN = "plan.json"
DONE = "unit.json"
KEY = "leaderboard.out_dir"


@dataclass
class Plan:
    """What every job of a sharded board reads: the board's config, its labels, its units and each
    (dataset, label)'s run config, as the submitting command composed them."""
    base: DictConfig
    labels: list[str]
    units: list[Unit]
    runs: dict  # (dataset, label) -> run config
    overrides: list[str]

    def as_json(self) -> str:
        runs: dict = {}
        for (ds, label), cfg in self.runs.items():
            runs.setdefault(ds, {})[label] = OmegaConf.to_container(cfg, resolve=True)
        return json.dumps({"base": OmegaConf.to_container(self.base, resolve=True), "labels": self.labels,
                           "units": [u.as_dict() for u in self.units], "runs": runs, "overrides": self.overrides},
                          indent=1)


def plan_path(out_dir: Path) -> Path:
    return Path(out_dir) / "units" / PLAN


def unit_dir(out_dir: Path, unit: Unit) -> Path:
    return Path(out_dir) / "units" / unit.name


def finished(out_dir: Path, unit: Unit) -> bool:
    return (unit_dir(out_dir, unit) / DONE).is_file()


def load_plan(out_dir: Path) -> Plan:
    path = plan_path(out_dir)
    try:
        data = json.loads(path.read_text())
        units = [Unit(u["name"], u["dataset"], tuple(u["labels"]), u["start"], u["stop"], u["turns"])
                 for u in data["units"]]
        runs = {(ds, label): OmegaConf.create(cfg) for ds, by_label in data["runs"].items()
                for label, cfg in by_label.items()}
        return Plan(OmegaConf.create(data["base"]), list(data["labels"]), units, runs, list(data["overrides"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"{path}: no sharded board's plan here ({error_reason(e)}); a sharded board is run by "
                         f"python -m bench.leaderboard ... hydra/launcher=<launcher>: give its {KEY}") from None


def identity(info: dict) -> dict:
    """What units merged into one table must share: the code (commit, and a dirty tree's diff) and the
    model (what was loaded, its shape, its dtype)."""
    return {"commit": info.get("git_commit"), "dirty": info.get("git_dirty"), "diff": info.get("git_diff"),
            "model": info.get("model_source"), "shape": info.get("model_flops_spec"), "dtype": info.get("dtype")}


def code_identity() -> dict:
    """This checkout's commit, whether its tracked files differ from it, and a digest of how."""
    diff = provenance.git_output("diff", "HEAD")
    return {"git_commit": provenance.git_output("rev-parse", "HEAD"), "git_dirty": bool(diff),
            "git_diff": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None}


def differs(a: dict, b: dict) -> str | None:
    """The first of identity()'s keys in which two provenances differ, said as `key: a, b`; None if none."""
    for key, value in identity(a).items():
        other = identity(b)[key]
        if value != other and not (key in ("model", "shape", "dtype") and None in (value, other)):
            return f"{key}: {json.dumps(value)[:80]} and {json.dumps(other)[:80]}"
    return None


def read_provenance(where: Path) -> dict:
    path = where / "provenance.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise BenchError(f"{path} is damaged, so the unit's commit and model cannot be checked; restore it, or "
                         "remove the unit's directory to run it again") from None


def run_unit(out_dir: Path, index: int) -> None:
    """Runs what is missing of the plan's unit `index`, then marks it finished."""
    plan = load_plan(out_dir)
    if not (isinstance(index, int) and 0 <= index < len(plan.units)):
        raise BenchError(f"leaderboard.cluster.unit={index!r}: the plan in {out_dir} has units 0-{len(plan.units) - 1}")
    unit = plan.units[index]
    where = unit_dir(out_dir, unit)
    runs = {(unit.dataset, label): plan.runs[unit.dataset, label] for label in unit.labels}
    for (ds, label), cfg in runs.items():
        rundir.check_resume(where / ds / label, cfg, True, KEY, ignore=("leaderboard",))
    first = runs[unit.dataset, REFERENCE]
    check_devices(first)
    if first.threads:
        torch.set_num_threads(first.threads)
    lm = load_target({label: runs[unit.dataset, label] for label in unit.labels})
    info = {**provenance.collect(lm), **code_identity()}
    earlier = read_provenance(where)
    if earlier and (why := differs(earlier, info)):
        raise BenchError(f"{where} was started with another build ({why}); its records would mix them: finish it "
                         f"with that one, or remove the unit's directory to run it again")
    rundir.claim_board(where)
    attempt = {"node": info["node"], "device_name": info["device_name"], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "slurm_job": os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID"))}
    attempts = [*earlier.get("attempts", []), attempt]

    def write_provenance() -> None:
        rundir.write_atomic(where / "provenance.json",
                            json.dumps({**info, "unit": unit.as_dict(), "attempts": attempts}, indent=2))

    write_provenance()
    board = plan.base.leaderboard
    speed: dict = {}
    records = run_dataset(unit.dataset, list(unit.labels), runs, where, {"lm": lm}, repeats=board.repeats,
                          turns=board.get("turns", "first"), speed=speed, questions=slice(unit.start, unit.stop))
    attempt["reference_step"] = speed.get(unit.dataset)
    write_summaries(where, {(unit.dataset, label): recs for label, recs in records.items()})
    cost = verification_cost(lm, list(board.verification_tokens))
    rundir.write_atomic(where / "verification_cost.csv", cost.to_csv(index=False))
    write_provenance()  # with the reference's speed check
    rundir.write_atomic(where / DONE, json.dumps({**unit.as_dict(), "node": info["node"],
                                                  "finished": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")


def unit_job(cfg: DictConfig) -> str:
    """Hydra's task function for a unit's job (its config: leaderboard.out_dir and leaderboard.cluster.unit).
    Returns "done", or why the unit did not finish: a job never raises, so that the launcher waits for
    every unit and the submitting command lists every unfinished one."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    index = cfg.leaderboard.cluster.unit
    try:
        run_unit(Path(cfg.leaderboard.out_dir), index)
        return "done"
    except Stopped:
        reason = f"unit {index}: stopped by SIGTERM (scancel, or the job's time limit); its finished records are kept"
    except BenchError as e:
        reason = f"unit {index}: {' '.join(error_reason(e).split())}"
    except Exception as e:  # a bug: its traceback in the job's log, the reason in the summary
        traceback.print_exc()
        reason = f"unit {index}: failed ({type(e).__name__}: {' '.join(str(e).split())[:300]}; traceback in its log)"
    print(f"error: {reason}", file=sys.stderr, flush=True)
    return reason
