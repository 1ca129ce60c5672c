"""`python -m bench [overrides]`: one Hydra run (or a multirun sweep with -m).

Bad input ends with one line on stderr and exit code 2. Overrides are checked before
Hydra starts, so that an unknown config choice or an invalid value fails the same way in
a single run and before the first job of a sweep.
"""
from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("decoder", "model", "dataset", "logger")
MAX_CHECKED_COMBINATIONS = 256


def fail(message) -> None:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


def _reason(e: BaseException) -> str:
    """The most specific non-empty message along an exception's cause chain."""
    while not str(e).strip() and e.__cause__ is not None:
        e = e.__cause__
    return str(e).strip() or type(e).__name__


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def precheck(argv: list[str]) -> None:
    """Compose the config for every combination of the given (sweep) overrides and check it."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .errors import BenchError
    from .runner import check_config

    try:
        args = get_args_parser().parse_intermixed_args(argv)
    except SystemExit:
        return  # not our arguments to judge: Hydra reports its own usage errors
    if args.help or args.hydra_help or args.cfg or args.info or args.shell_completion or args.experimental_rerun:
        return  # Hydra prints something and runs nothing
    overrides = args.overrides
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        fail(f"cannot parse overrides: {_reason(e)}")
    options = []
    for override in parsed:
        key = override.get_key_element()
        if key.startswith(("hydra", "+hydra", "~hydra")):
            continue
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.get_value_element_as_str()]
        group = key.lstrip("+~").split("@")[0]
        if group in GROUPS:
            for value in values:
                if value not in _choices(group):
                    fail(f"unknown {group} {value!r}; choose one of: {', '.join(_choices(group))}")
        options.append([f"{key}={v}" for v in values])
    combos = list(itertools.islice(itertools.product(*options), MAX_CHECKED_COMBINATIONS))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for combo in combos:
            try:
                cfg = compose("config", overrides=list(combo), return_hydra_config=True)
            except Exception as e:
                fail(f"{' '.join(combo)}: {_reason(e)}")
            HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} resolve while checking
            try:
                check_config(cfg)
            except BenchError as e:
                fail(e)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def app(cfg: DictConfig) -> None:
    from .errors import BenchError
    from .metrics import to_markdown
    from .runner import build, run

    logging.getLogger("transformers").setLevel(logging.ERROR)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        logger = build(cfg.logger, "logger")
        logger.start(cfg, run_dir)
        try:
            summary = run(cfg, run_dir, logger)
        finally:
            logger.finish()
    except BenchError as e:
        fail(e)
    print(to_markdown(summary))
    print(f"\nrun directory: {run_dir}")


def main() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    precheck(sys.argv[1:])
    app()


if __name__ == "__main__":
    main()
