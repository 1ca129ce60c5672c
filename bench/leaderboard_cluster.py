"""`python -m bench.leaderboard [overrides] hydra/launcher=slurm|slurm_cpu|joblib [--dry-run]`: the
leaderboard as units of work (bench/leaderboard_plan.py), one job each through the Hydra launcher named,
then merged into the tables the one-process run writes (bench/leaderboard_merge.py).

The command plans the units and prints them with their expected tokens, forwards and time; refuses
(one line, exit 2, nothing submitted) a unit that would not fit a node, a leaderboard.out_dir planned
otherwise, or units started at another commit or tree; writes <out_dir>/units/plan.json; submits the
units not yet finished as one multirun (Hydra's launcher: a SLURM job array through submitit, or local
processes through joblib), each job running bench/leaderboard_unit.py in <out_dir>/units/<unit>/;
waits for them, and merges once every unit is finished. A unit that did not finish (cancelled, timed
out, failed) keeps its finished records: the same command again submits only what is missing, each
unit resuming on its own, then merges (exit 1 until then). Jobs' logs: <out_dir>/jobs/.
--dry-run prints the plan and stops; without a launcher it plans the one-process run.
"""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from . import rundir
from .__main__ import CONF_DIR, check_writable, error_reason, hydra_quote
from .errors import BenchError
from .leaderboard_plan import check_fit, describe, expected, make_units, node_of
from .leaderboard_unit import KEY, Plan, code_identity, differs, finished, load_plan, plan_path, read_provenance, \
    unit_dir, unit_job

OWN_KEYS = ("hydra.sweep.dir", "hydra.sweep.subdir", "leaderboard.out_dir", "leaderboard.cluster.unit")


class Unfinished(Exception):
    """Units that did not finish; their records are kept and the same command resumes them."""


def launcher_config(overrides: list[str]) -> DictConfig:
    """hydra.launcher as the command line composes it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return compose("leaderboard", overrides=overrides, return_hydra_config=True).hydra.launcher
        except Exception as e:
            raise BenchError(f"{' '.join(overrides)}: {error_reason(e)}") from None


def plan_board(base: DictConfig, labels: list[str], runs: dict, overrides: list[str], choice: str | None
               ) -> tuple[Plan, str]:
    """The plan and its printed form (choice: the launcher; None: the one-process run's); a unit that
    would not fit a node is refused here."""
    launcher = launcher_config(overrides)
    if "SlurmLauncher" in str(launcher.get("_target_", "")):
        for cfg in runs.values():  # what SLURM_CPUS_PER_TASK gives inside the task, pinned in the plan
            if cfg.threads is None:
                cfg.threads = launcher.cpus_per_task
    units = make_units(base, labels, runs, whole=choice is None)
    node = node_of(base, launcher, choice or "basic")
    need = check_fit(units, runs, node)
    text = describe(units, expected(units, base, runs), need, node, base, choice)
    return Plan(base, labels, units, runs, overrides), text


def check_out_dir(plan: Plan, out_dir: Path) -> None:
    """leaderboard.out_dir new, or this plan's board: its units resumable with these settings, at this
    commit and tree. Writes nothing."""
    rundir.check_board_dir(out_dir)
    check_writable(KEY, str(out_dir))
    for ds in plan.base.leaderboard.datasets:
        if (out_dir / ds).is_dir():
            raise BenchError(f"{KEY}={out_dir} holds a one-process leaderboard ({out_dir / ds}); a sharded one is "
                             f"written beside no other: choose a new {KEY}")
    if plan_path(out_dir).is_file():
        before = load_plan(out_dir)
        started = [u for u in before.units if any(rundir.has_records(unit_dir(out_dir, u) / u.dataset / label)
                                                  for label in u.labels)]
        if started and [u.as_dict() for u in before.units] != [u.as_dict() for u in plan.units]:
            raise BenchError(f"{KEY}={out_dir} holds units planned otherwise ({len(before.units)} units, the first "
                             f"{before.units[0].name}; now {len(plan.units)}, the first {plan.units[0].name}): rerun "
                             f"with its leaderboard.cluster and board settings, or choose a new {KEY}")
    here = code_identity()
    for u in plan.units:
        for label in u.labels:
            rundir.check_resume(unit_dir(out_dir, u) / u.dataset / label, plan.runs[u.dataset, label], True, KEY,
                                ignore=("leaderboard",))
        earlier = read_provenance(unit_dir(out_dir, u))
        why = differs({**earlier, **here}, earlier) if earlier else None  # the code's part
        if why:
            raise BenchError(f"unit {u.name} was started with another build ({why}); a table merges one: finish "
                             f"its units with that checkout, or choose a new {KEY}")


def launch(out_dir: Path, units: list[int], overrides: list[str]) -> list[str]:
    """The units' jobs as one Hydra multirun through the command line's launcher; returns why each
    unfinished one did not finish, where its job said."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .__main__ import _is_hydra

    kept = [o.input_line for o in OverridesParser.create().parse_overrides(overrides)
            if _is_hydra(o) and not o.get_key_element().lstrip("+~").startswith(OWN_KEYS)]
    job = [*kept, f"{KEY}={hydra_quote(out_dir)}", f"leaderboard.cluster.unit={','.join(map(str, units))}",
           f"hydra.sweep.dir={hydra_quote(out_dir / 'jobs')}", "hydra.sweep.subdir=unit${leaderboard.cluster.unit}"]
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2("leaderboard", create_config_search_path(str(CONF_DIR)))
    try:
        returns = hydra.multirun("leaderboard", unit_job, job)
    except Exception as e:  # a job that ended without a result (killed, out of memory): the units' directories tell
        return [f"the launcher: {' '.join(error_reason(e).split())[:300]}"]
    finally:
        GlobalHydra.instance().clear()
    return [r.return_value for batch in returns for r in batch if r.return_value != "done"]


def run_cluster(base: DictConfig, labels: list[str], runs: dict, overrides: list[str], launcher: str | None,
                dry_run: bool) -> str:
    """Plans, submits what is unfinished, waits, merges; returns the plan (--dry-run) or leaderboard.md."""
    plan, text = plan_board(base, labels, runs, overrides, launcher)
    if dry_run:
        return text
    out_dir = Path(str(base.leaderboard.out_dir)).absolute()
    check_out_dir(plan, out_dir)
    print(text, flush=True)
    rundir.claim_board(out_dir)
    rundir.write_atomic(plan_path(out_dir), plan.as_json())
    todo = [i for i, u in enumerate(plan.units) if not finished(out_dir, u)]
    reasons = launch(out_dir, todo, overrides) if todo else []
    waiting = [u for u in plan.units if not finished(out_dir, u)]
    if waiting:
        raise Unfinished("\n".join([*reasons, f"{len(waiting)} of {len(plan.units)} units did not finish "
                                    f"({', '.join(u.name for u in waiting[:6])}{', ...' if len(waiting) > 6 else ''})"
                                    "; their finished records are kept: once none of their jobs runs, rerun the same "
                                    "command to finish them and merge"]))
    from .leaderboard_merge import merge

    return merge(out_dir)
