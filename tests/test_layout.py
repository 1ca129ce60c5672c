"""The layout is the architecture (DESIGN.md): imports go methods -> tuning -> core, never back."""
import ast
from pathlib import Path

import pytest

from bench.registry import decoder_configs
from helpers import EXTRA_CONF_DIRS, searchpath

DECODERS = Path(__file__).resolve().parent.parent / "decoders"
ALLOWED = {"core": {"core"}, "tuning": {"core", "tuning"}, "methods": {"core", "tuning", "methods"}}


def decoder_imports(path: Path) -> set[str]:
    """The decoders subpackages a module imports from (relative or absolute)."""
    package = path.parent.name
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                found.add(package)
            elif node.level == 2 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.startswith("decoders."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("decoders."))
    return found


@pytest.mark.parametrize("path", sorted(DECODERS.glob("*/*.py")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_imports_go_one_way(path):
    package = path.parent.name
    assert decoder_imports(path) <= ALLOWED[package], f"{package}/{path.name} imports {decoder_imports(path)}"


@pytest.mark.parametrize("name", decoder_configs(EXTRA_CONF_DIRS))
def test_every_method_config_builds_a_decoder(name):
    """Each method's YAML (conf/decoder/*.yaml, bench/registry.py) builds an object the runner
    accepts (decoders.core.contract.Decoder), named as its file."""
    from hydra import compose, initialize_config_dir

    from bench.runner import check_config
    from decoders.core.contract import Decoder

    with initialize_config_dir(config_dir=str(DECODERS.parent / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"decoder={name}", "model=tiny-random", *searchpath()])
    _, decoder = check_config(cfg)
    assert isinstance(decoder, Decoder) and decoder.name == name
