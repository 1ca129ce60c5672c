"""The layout is the architecture (DESIGN.md): imports go methods -> tuning -> core, never back.
And the checkout travels to the GPU machine with the GPU kit: the tracked tree stays small."""
import ast
import subprocess
from pathlib import Path

import pytest

from bench.registry import decoder_configs
from helpers import EXTRA_CONF_DIRS, searchpath

REPO = Path(__file__).resolve().parent.parent
DECODERS = REPO / "decoders"
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


def module_imports() -> dict[str, set[str]]:
    """bench's and decoders' modules -> the modules of theirs each imports, at the top or inside a
    function (a circle hidden in a function is still a circle)."""
    modules = {}
    for f in [*(REPO / "bench").rglob("*.py"), *DECODERS.rglob("*.py")]:
        parts = f.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in modules.items():
        package = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level \
                    else node.module or ""
                targets = [base.rstrip("."), *(f"{base}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each group of two or more modules that reach one another."""
    reach = {m: set() for m in graph}
    for m in graph:
        todo = list(graph[m])
        while todo:
            n = todo.pop()
            if n not in reach[m]:
                reach[m].add(n)
                todo.extend(graph[n])
    groups = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def test_no_import_circles():
    """leaderboard <-> spec_bench_table, runner <-> rundir and heads <-> published imported
    each other, some inside functions to get by."""
    assert circles(module_imports()) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check finds one


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


# A device run carries the working tree and the GPU kit together, 64 MiB at most (scripts/gpu/prepare.sh
# refuses more), so the tracked tree stays under what the kit leaves. The kit (.gpu/) is the project's
# wheels the GPU image lacks, the MT-Bench / GSM8K / Spec-Bench copies and SmolLM2's tokenizer: its size
# is set by those versions and files, not by the date or the CPU that makes it. GPU_KIT is what
# prepare.sh measured (its "kit ... bytes"); tests/test_gpu_kit.py checks that the kit still fits it.
# A run directory checked in under results/ keeps its records gzipped (records.jsonl.gz, gzip -9 -n:
# 4.5x smaller; every reader takes it, bench/records.py).
MiB = 2**20
DEVICE_LIMIT = 64 * MiB
GPU_KIT = 10_863_489
MAX_TRACKED = DEVICE_LIMIT - GPU_KIT
MAX_PLAIN_RECORDS = 256 * 2**10


def tracked_sizes() -> dict[str, int]:
    """Each tracked file (git ls-files: the index) and its size in the working tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return {p: (REPO / p).stat().st_size for p in out.decode().split("\0") if p and (REPO / p).is_file()}


def too_big(sizes: dict[str, int], max_tracked: int = MAX_TRACKED,
            max_plain_records: int = MAX_PLAIN_RECORDS) -> list[str]:
    """What breaks the bounds, one line each, naming the files."""
    problems = [f"{p}: a plain records.jsonl of {sizes[p] / 2**10:.0f} KiB under results/ (over "
                f"{max_plain_records / 2**10:.0f} KiB): gzip -9 -n it (records.jsonl.gz)"
                for p in sorted(sizes) if p.startswith("results/") and Path(p).name == "records.jsonl"
                and sizes[p] > max_plain_records]
    total = sum(sizes.values())
    if total > max_tracked:
        largest = sorted(sizes, key=lambda p: -sizes[p])[:8]
        problems.append(f"the tracked tree is {total / MiB:.1f} MiB, over {max_tracked / MiB:.1f} MiB; the largest "
                        f"files: {', '.join(f'{p} ({sizes[p] / MiB:.1f} MiB)' for p in largest)}")
    return problems


def test_no_large_plain_records_are_tracked():
    assert not (problems := too_big(tracked_sizes(), max_tracked=2**62)), "\n".join(problems)


def test_the_tracked_tree_leaves_room_for_the_gpu_kit():
    """Tree + kit under the device's 64 MiB: what ships is chosen by bytes per benefit (adapters/README.md)."""
    assert not (problems := too_big(tracked_sizes(), max_plain_records=2**62)), "\n".join(problems)


def test_the_size_check_names_the_offending_files():
    sizes = {"adapters/a.safetensors": 30 * MiB, "results/reference/x/records.jsonl": 300 * 2**10,
             "results/reference/y/records.jsonl.gz": 3 * MiB, "tests/fixtures/records.jsonl": 1 * MiB}
    problems = too_big(sizes, max_tracked=32 * MiB)
    assert len(problems) == 2 and problems[0].startswith("results/reference/x/records.jsonl: a plain records.jsonl")
    assert problems[1].startswith("the tracked tree is 34.3 MiB, over 32.0 MiB; the largest files: "
                                  "adapters/a.safetensors (30.0 MiB), results/reference/y/records.jsonl.gz (3.0 MiB)")
    del sizes["adapters/a.safetensors"]
    assert too_big(sizes, max_plain_records=400 * 2**10) == []


def test_code_imports_the_package_without_editing_sys_path():
    """scripts/ are programs over the installed package (pip install -e .), and bench/ and decoders/ are that
    package: none of them edits sys.path to import it (library code lives in the package)."""
    edits = [f"{p.relative_to(REPO)}:{n}" for folder in ("scripts", "bench", "decoders")
             for p in sorted((REPO / folder).rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if "sys.path" in line.split("#")[0]]
    assert not edits, edits
