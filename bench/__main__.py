"""`python -m bench [overrides]`: one Hydra run, or a multirun sweep (-m, or a conf/sweep/
config such as +sweep=lookahead_grid, which sets hydra.mode=MULTIRUN and its grid).

Bad input ends with one line on stderr and exit code 2. Overrides are checked before
Hydra starts, so that an unknown config choice or an invalid value fails the same way in
a single run and before the first job of a sweep; what needs only the composed config
(bench/settings.py) is checked in every job before torch is imported.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from .errors import BenchError, fail
from .registry import decoder_configs, searchpath_dirs
from .settings import check_settings, check_writable_dir
from .usage import stop_if_parse_only

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("decoder", "model", "dataset", "draft", "logger", "sweep")
MAX_CHECKED_COMBINATIONS = 256
# Where Hydra itself would write files (.hydra/, log files): fixed, so that a run writes only into its directory.
FIXED_HYDRA_KEYS = ("hydra.output_subdir", "hydra.job_logging", "hydra.hydra_logging")
# Keys renamed after commands were written with them: Hydra's own error would not name the new key.
RENAMED_KEYS = {"decoder.head": "decoder.draft_weights", "decoder.head_seed": "decoder.draft_seed"}


def error_reason(e: BaseException) -> str:
    """The most specific non-empty message along an exception's cause chain."""
    while not str(e).strip() and e.__cause__ is not None:
        e = e.__cause__
    return str(e).strip() or type(e).__name__


def config_choices(group: str) -> list[str]:
    """The configs a Hydra group offers (conf/<group>/*.yaml), by name."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_choices(overrides) -> None:
    for override in overrides:
        group = override.get_key_element().lstrip("+~").split("@")[0]
        if group in GROUPS:
            values = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                      else [override.get_value_element_as_str()])
            for value in values:
                if value not in config_choices(group):
                    fail(f"unknown {group} {value!r}; choose one of: {', '.join(config_choices(group))}")


def _check_renamed(overrides) -> None:
    for override in overrides:
        key = override.get_key_element().lstrip("+~")
        if key in RENAMED_KEYS:
            new = RENAMED_KEYS[key]
            fail(f"{key} is now {new}; use {override.input_line.lstrip('+').replace(key, new, 1)}")


def _sweeper_params(overrides, multirun: bool) -> list[str]:
    """The grid a sweep config puts in hydra.sweeper.params (e.g. +sweep=lookahead_grid), read
    as Hydra's multirun does: from the config composed with the non-sweep overrides."""
    from hydra import compose
    from hydra.types import RunMode

    fixed = [o.input_line for o in overrides if not o.is_sweep_override()]
    try:
        base = compose("config", overrides=fixed, return_hydra_config=True)
    except Exception as e:
        fail(f"{' '.join(fixed)}: {error_reason(e)}")
    basic = base.hydra.sweeper.get("_target_", "").endswith(".BasicSweeper")
    if not (multirun or base.hydra.mode == RunMode.MULTIRUN) or not basic:
        return []
    return [f"{k}={v}" for k, v in (base.hydra.sweeper.get("params") or {}).items()]


def precheck(argv: list[str]) -> None:
    """Compose the config of every job of the run or sweep and check it: the command line's
    comma lists and, in a multirun, the grid of the sweep config, combined as Hydra's basic
    sweeper combines them (a key given on the command line replaces the config's)."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = get_args_parser().parse_intermixed_args(argv)
    except SystemExit:
        return  # not our arguments to judge: Hydra reports its own usage errors
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.experimental_rerun:
        return  # Hydra prints something and runs nothing
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(args.overrides)
    except Exception as e:
        fail(f"cannot parse overrides: {error_reason(e)}")
    for o in parsed:
        key = o.get_key_element().lstrip("+~")
        if key.startswith(FIXED_HYDRA_KEYS):
            fail(f"{key}: not overridable here (a run writes only into its own directory, .hydra/ included); "
                 "choose where with hydra.run.dir or hydra.sweep.dir")
    _check_renamed(parsed)
    try:
        decoder_configs(searchpath_dirs(args.overrides))  # every method's YAML: its name is its file's
    except BenchError as e:
        fail(e)
    # With an extra search path Hydra may know choices conf/ lacks: leave those to its own error.
    local_choices = not any(o.get_key_element() == "hydra.searchpath" for o in parsed)
    if local_choices:
        _check_choices(parsed)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            grid = parser.parse_overrides(_sweeper_params(parsed, args.multirun))
        except Exception as e:
            fail(f"hydra.sweeper.params: {error_reason(e)}")
        _check_renamed(grid)
        if local_choices:
            _check_choices(grid)
        # As in Hydra's multirun: every job composes the hydra overrides plus its own combination.
        hydra_overrides = [o.input_line for o in grid + parsed if _is_hydra(o) and not o.is_sweep_override()]
        try:
            combos = BasicSweeper.split_arguments([o for o in grid + parsed if not _is_hydra(o)], None)[0]
        except Exception as e:
            fail(error_reason(e))
        _check_jobs([_compose_job(hydra_overrides, combo) for combo in combos[:MAX_CHECKED_COMBINATIONS]],
                    args.multirun)


def script_args(parser, argv: list[str] | None = None, config: str | None = "config"):
    """A script's own options (argparse), and the rest as the Hydra overrides it composes `config`
    with: each must parse as an override and the config must compose with them, else one line naming
    the argument and exit 2 (an unknown option such as --frob, or a bare path, was Hydra's traceback)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args, overrides = parser.parse_known_args(argv)
    hydra_parser = OverridesParser.create()
    for arg in overrides:
        try:
            hydra_parser.parse_override(arg)
        except Exception:
            fail(f"{arg}: neither an option of {parser.prog} (see --help) nor a Hydra override such as "
                 "model=tiny-random or gen.max_new_tokens=64")
    if config is not None:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            try:
                compose(config, overrides=overrides)
            except Exception as e:
                fail(f"{' '.join(overrides)}: {error_reason(e)}")
    stop_if_parse_only()
    return args, overrides


def _is_hydra(override) -> bool:
    return override.get_key_element().lstrip("+~").startswith("hydra")


def check_writable(key: str, path: str) -> None:
    """Where Hydra will write (its run or sweep directory) must take files: else one line now,
    not Hydra's traceback after it has made half a directory."""
    try:
        check_writable_dir(key, path, "choose a writable directory")
    except BenchError as e:
        fail(e)


def _compose_job(hydra_overrides: list[str], overrides: list[str]) -> DictConfig:
    from hydra import compose

    try:
        return compose("config", overrides=hydra_overrides + overrides, return_hydra_config=True)
    except Exception as e:
        fail(f"{' '.join(overrides)}: {error_reason(e)}")


def _check_jobs(jobs: list[DictConfig], multirun: bool) -> None:
    """Every job's own settings first (bench/settings.py): they need no torch, whose import takes
    seconds, so a bad value in any job is one line at once. Then each job as it will run: its
    decoder and model spec built, its devices, and its directory."""
    for cfg in jobs:
        HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} resolve while checking
        try:
            check_settings(cfg)
        except BenchError as e:
            fail(e)
    for i, cfg in enumerate(jobs):
        _check_job(cfg, multirun, first=i == 0)


def _check_job(cfg: DictConfig, multirun: bool, first: bool) -> None:
    from hydra.types import RunMode
    from omegaconf import open_dict

    from . import rundir
    from .runner import check_config

    HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} resolve while checking
    sweep = multirun or cfg.hydra.mode == RunMode.MULTIRUN
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    try:
        check_config(cfg)
        check_devices(cfg)
        # The job's directory, before Hydra writes anything there: only a run's own, and its records
        # only resumed with the settings they were made with.
        if first and sweep:
            rundir.check_sweep_dir(Path(cfg.hydra.sweep.dir))
        job = cfg.copy()  # the config the job will run: without the hydra node, as Hydra hands it over
        with open_dict(job):
            del job["hydra"]
            if job.threads is None and "SlurmLauncher" in str(cfg.hydra.launcher.get("_target_", "")):
                job.threads = cfg.hydra.launcher.cpus_per_task  # what SLURM_CPUS_PER_TASK gives inside the task
        run_dir = rundir.job_dir(cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir) if sweep else Path(cfg.hydra.run.dir)
        rundir.check_resume(run_dir, job, cfg.resume, key)
    except BenchError as e:
        fail(e)
    if first:  # is its output directory writable?
        check_writable(key, cfg.hydra.sweep.dir if sweep else cfg.hydra.run.dir)
    if first and sweep:
        check_launcher(cfg)


def check_launcher(cfg: DictConfig) -> None:
    """A SLURM launcher submits with sbatch and srun (submitit's own check): where they are missing,
    one line now, not submitit's traceback after Hydra wrote multirun.yaml into the sweep directory."""
    import shutil

    target = str(cfg.hydra.launcher.get("_target_", ""))
    missing = [tool for tool in ("sbatch", "srun") if shutil.which(tool) is None]
    if "SlurmLauncher" in target and missing:
        fail(f"hydra/launcher: a SLURM launcher submits each job with sbatch and srun, and this machine has no "
             f"{' or '.join(missing)} on its PATH; run on a SLURM cluster's login node (a one-machine cluster: "
             "scripts/slurm/start_cluster.sh), or leave hydra/launcher out to run the sweep here")


def check_devices(cfg) -> None:
    """Devices this torch can use: else one line now, not a traceback at the model's load."""
    import torch
    from omegaconf import OmegaConf

    from .models import resolve_device

    for key in ("device", "model.device", "draft.device"):
        value = OmegaConf.select(cfg, key, default=None)
        device = resolve_device(str(value)) if value is not None else None  # not a device, or CUDA without one
        if device is not None and device.type not in ("cpu", "cuda"):
            try:
                torch.empty(0, device=device)
            except (RuntimeError, AssertionError):
                raise BenchError(f"{key}={value}: this torch build cannot use {device.type} devices; "
                                 "use auto, cpu, cuda or cuda:N") from None


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def app(cfg: DictConfig) -> None:
    from . import rundir
    from .ending import comparison
    from .errors import BenchError
    from .records import iter_records
    from .runner import build, run

    from hydra.types import RunMode

    logging.getLogger("transformers").setLevel(logging.ERROR)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    key = "hydra.sweep.dir" if hydra_cfg.mode == RunMode.MULTIRUN else "hydra.run.dir"
    try:
        if hydra_cfg.mode == RunMode.MULTIRUN:  # checked before Hydra starts for the first jobs; here for every one
            rundir.job_dir(hydra_cfg.sweep.dir, hydra_cfg.sweep.subdir)
        logger = build(cfg.logger, "logger")  # started by run(), once the directory is the run's
        try:
            run(cfg, run_dir, logger, hydra=hydra_cfg, key=key)
        finally:
            logger.finish()
    except BenchError as e:
        fail(e)
    except KeyboardInterrupt:  # finished records are on disk: say how to go on, no traceback
        print(f"\ninterrupted: the finished records are in {run_dir}; continue with\n  {resume_command(run_dir)}",
              file=sys.stderr)
        sys.exit(130)
    # A few lines that answer the question; summary.md/.csv in run_dir hold every figure.
    try:
        print(comparison(iter_records(run_dir / "records.jsonl"), run_dir))
    except BenchError as e:
        fail(e)


def resume_command(run_dir: Path) -> str:
    """This command line again, resuming into the same run (or sweep) directory."""
    from hydra.types import RunMode

    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    kept = [a for a in sys.argv[1:] if not a.startswith(("resume=", "hydra.run.dir=", "hydra.sweep.dir="))]
    where = f"hydra.sweep.dir={hydra_quote(hc.sweep.dir)}" if sweep else f"hydra.run.dir={hydra_quote(run_dir)}"
    return shlex.join(["python", "-m", "bench", *kept, "resume=true", where])  # pasted into a shell


def hydra_quote(value) -> str:
    """`value` as an override's value Hydra reads back unchanged: quoted where it has more than
    word characters, dots, dashes and slashes (a space, a comma, a quote)."""
    value = str(value)
    if re.fullmatch(r"[\w./-]+", value):
        return value
    # In Hydra's quoted strings a quote is escaped, and so are the backslashes before a quote or the end.
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value) + "'"


def main() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    precheck(sys.argv[1:])
    stop_if_parse_only()
    app()


if __name__ == "__main__":
    main()
