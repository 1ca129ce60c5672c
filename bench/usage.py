"""Every command's --help: its manual (the module's docstring, as written) and its options; its bad
input ended as every command ends it (bench/errors.py: one line, exit code 2); and BENCH_PARSE_ONLY=1,
under which a command checks its arguments (and composes its config) and stops there, running nothing:
how the manual's examples are tested (tests/test_docs.py)."""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from .errors import fail

OVERRIDES = ("Any other argument is a Hydra override of conf/config.yaml, such as model=tiny-random or "
             "gen.max_new_tokens=64: `python -m bench --help` lists the groups and keys.")


class Parser(argparse.ArgumentParser):
    """argparse for an entry point: `doc` above the options in --help, kept as written; `overrides`: the
    command also takes Hydra overrides (bench.__main__.script_args), which the help says."""

    def __init__(self, doc: str, prog: str, overrides: bool = False, **kwargs):
        super().__init__(prog=prog, description=doc.strip(), formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=OVERRIDES if overrides else None, **kwargs)
        self.takes_overrides = overrides

    def error(self, message: str):
        fail(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if not self.takes_overrides:  # else script_args stops, once the config composed
            stop_if_parse_only()
        return parsed


def stop_if_parse_only() -> None:
    """Under BENCH_PARSE_ONLY=1, the arguments were checked: say so and exit 0 before anything runs."""
    if os.environ.get("BENCH_PARSE_ONLY"):
        print("BENCH_PARSE_ONLY: the arguments are valid; nothing was run")
        sys.exit(0)


def asks_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def config_block(path: Path, key: str) -> str:
    """The `key:` block of a conf YAML file as written, its defaults and their comments: the options of a
    command that takes Hydra overrides only (bench.leaderboard)."""
    lines = path.read_text().splitlines()
    start = lines.index(f"{key}:")
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"[^\s#]", lines[i])), len(lines))
    return "\n".join(lines[start:end]).rstrip()
