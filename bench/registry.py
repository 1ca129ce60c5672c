"""The decoding methods: a method is registered by its YAML, conf/decoder/<name>.yaml, and nowhere
else. The greedy-equality and layout tests, the leaderboard's default entries and the CLI's
checks all list the methods from here.

A YAML's `name` must be its file's name: the run directory, the records and the leaderboard
label take the name, `decoder=<name>` takes the file. Methods kept outside this checkout join
through Hydra's search path: `hydra.searchpath=[file://DIR/conf]` adds DIR/conf/decoder/*.yaml
(and PYTHONPATH=DIR adds DIR/decoders/methods/*.py to decoders.methods, decoders/__init__.py).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from .errors import BenchError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
REFERENCE = "autoregressive"  # the method every speedup is against: the leaderboard's reference entry
ENTRIES_NODE = "decoder_entries"  # the config conf/leaderboard.yaml's defaults list takes the default entries from
# Methods that are no default leaderboard entry. The oracle drafts from the target's own output (an
# instrument for a device's speedup against acceptance, not a method one could run): beside the
# methods it would read as the fastest. It joins a board when named: +leaderboard.decoders.<label>=[decoder=oracle].
NOT_DEFAULT_ENTRIES = frozenset({"oracle"})


def decoder_configs(extra_conf_dirs=()) -> dict[str, Path]:
    """Every method, by name, and its YAML: conf/decoder/*.yaml, then each extra conf directory's
    decoder/*.yaml (as on Hydra's search path, the first directory holding a name wins). A YAML
    whose `name` is not its file's name is refused in one line."""
    found: dict[str, Path] = {}
    for conf in (CONF_DIR, *map(Path, extra_conf_dirs)):
        for path in sorted((conf / "decoder").glob("*.yaml")):
            found.setdefault(path.stem, path)
    for name, path in found.items():
        try:
            declared = (yaml.safe_load(path.read_text()) or {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError) as e:
            raise BenchError(f"{path}: not a readable YAML mapping ({' '.join(str(e).split())[:200]})") from None
        if declared != name:
            raise BenchError(f"{path}: name: {declared!r}; it must be {name!r}, the file's name "
                             "(decoder=<name> picks the file, records and run directories take the name)")
    return dict(sorted(found.items()))


def searchpath_dirs(overrides: list[str]) -> list[Path]:
    """The conf directories a hydra.searchpath=[file://DIR, ...] override adds (pkg:// entries are
    not listed here: their methods run, but are not found by decoder_configs)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    dirs = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.get_key_element() == "hydra.searchpath" and isinstance(override.value(), list):
            dirs += [Path(p[len("file://"):]) for p in override.value() if str(p).startswith("file://")]
    return dirs


def store_leaderboard_entries(extra_conf_dirs=()) -> list[str]:
    """Every method's default leaderboard entry, `<name>: [decoder=<name>]` (but NOT_DEFAULT_ENTRIES'), as
    the config node conf/leaderboard.yaml's defaults list takes before its own variants: composed before
    the command line's overrides, so `leaderboard.decoders.<name>=[...]` replaces one. Returns the names."""
    from hydra.core.config_store import ConfigStore

    names = [n for n in decoder_configs(extra_conf_dirs) if n not in NOT_DEFAULT_ENTRIES]
    ConfigStore.instance().store(name=ENTRIES_NODE,
                                 node={"leaderboard": {"decoders": {n: [f"decoder={n}"] for n in names}}})
    return names


def table_order(entries: dict[str, list[str]], methods, order=()) -> list[str]:
    """The leaderboard's labels in table (and run) order: the methods' default entries in
    leaderboard.order (those it does not name after them, by name), each followed by the variants
    that run its decoder (`decoder=<name>`), in the order given; any other entry last."""
    def runs(label: str) -> str | None:
        return next((o.split("=", 1)[1] for o in entries[label] if o.startswith("decoder=")), None)

    defaults = [m for m in order if m in entries and m in methods]
    defaults += sorted(m for m in entries if m in methods and m not in defaults)
    labels = []
    for name in defaults:
        labels += [name, *(label for label in entries if label not in methods and runs(label) == name)]
    return labels + [label for label in entries if label not in labels]
