"""Which `_target_` a config may name. Hydra's instantiate calls whatever `_target_` names, so a
command line (decoder._target_=builtins.open) or a run directory's config.yaml could run any
callable; every config is checked here before anything in it is instantiated.
"""
from __future__ import annotations

import inspect

from .errors import BenchError

# The modules whose classes conf/ builds: methods, models, datasets, loggers, the SLURM callback.
# A user's own method is a module of decoders.methods too: DIR/decoders/methods/<name>.py with DIR on
# PYTHONPATH joins the package (decoders/__init__.py), so no other module need be allowed for it.
ALLOWED = ("decoders.methods", "bench.models", "bench.datasets", "bench.loggers", "bench.slurm")
# Under hydra.*: Hydra's own launchers and sweepers (and its plugins'), besides ours.
ALLOWED_HYDRA = ("hydra", "hydra_plugins") + ALLOWED


def _within(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def check_target(key: str, value, modules: tuple[str, ...] = ALLOWED) -> None:
    """`value` must name a class defined in one of `modules`. The name is checked before it is
    imported (importing a module can run code), the object after (bench.models.os is not ours)."""
    from hydra._internal.utils import _locate

    allowed = f"a class in {', '.join(m + '.*' for m in modules)}"
    if not (isinstance(value, str) and _within(value, modules)):
        raise BenchError(f"{key}={value}: not allowed; _target_ may name only {allowed}")
    try:
        obj = _locate(value)
    except Exception:
        raise BenchError(f"{key}={value}: no such class; _target_ may name only {allowed}") from None
    if not (inspect.isclass(obj) and _within(obj.__module__, modules)):
        raise BenchError(f"{key}={value}: not allowed; _target_ may name only {allowed}")


def check_targets(node, where: str = "", resolve: bool = False) -> None:
    """Every `_target_` in a config (a DictConfig or a plain dict/list), at any depth; under a
    top-level `hydra` node Hydra's own classes are allowed too. Unresolved, a `_target_` must be
    a literal name (a node interpolation such as decoder.draft=${draft} is checked where it points);
    resolve=True checks a node as instantiate will see it."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=resolve)
    _walk(node, where, ALLOWED)


def _walk(node, where: str, modules: tuple[str, ...]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{where}{k}"
            if k == "_target_":
                check_target(key, v, modules)
            else:
                _walk(v, key + ".", ALLOWED_HYDRA if key == "hydra" else modules)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _walk(v, f"{where[:-1]}[{i}].", modules)
