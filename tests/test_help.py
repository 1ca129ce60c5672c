"""Every entry point answers --help with its manual and its options, exit code 0 and nothing on stderr:
python -m bench (Hydra's help: the groups and every key), the bench.* modules, and every product script
under scripts/ (found on disk, so a new one is checked too). Every bench module with a main() is one."""
from __future__ import annotations

import subprocess

import pytest

from helpers import REPO, run_python

# module -> what its help must list beside its manual
MODULES = {
    "bench": ["== Configuration groups ==", "decoder: autoregressive,", "gen:", "max_new_tokens: 128",
              "python -m bench [group=choice ...]", "docs/README.md"],
    "bench.report": ["usage: python -m bench.report", "--out", "--by-category"],
    "bench.leaderboard": ["python -m bench.leaderboard [+preset=NAME]", "leaderboard:", "limit: 5", "repeats: 1",
                          "only: null"],
    "bench.show": ["usage: python -m bench.show", "--prompt"],
    "bench.forecast": ["usage: python -m bench.forecast", "--profile"],
    "bench.replot": ["usage: python -m bench.replot", "--out"],
}
SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "scripts").rglob("*") if p.suffix in (".py", ".sh"))


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_a_modules_help_lists_its_options(module):
    out = run_python("-m", module, "--help")
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr[-2000:]
    missing = [s for s in MODULES[module] if s not in out.stdout]
    assert not missing, (missing, out.stdout[:3000])


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_scripts_help_is_its_manual_and_options(script):
    if script.endswith(".sh"):
        out = subprocess.run(["bash", script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
        header = (REPO / script).read_text().splitlines()[1].lstrip("# ")
        assert out.returncode == 0 and not out.stderr.strip() and out.stdout.startswith(header), out
        return
    out = run_python(REPO / script, "--help")
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr[-2000:]
    manual = (REPO / script).read_text().split('"""')[1].strip().splitlines()[0]
    assert manual in out.stdout, out.stdout[:2000]
    if script == "scripts/gpu/tie_probe.py":  # it takes python -m bench's arguments
        assert "python -m bench --help" in out.stdout
    else:
        assert f"usage: python {script}" in out.stdout and "-h, --help" in out.stdout, out.stdout[:2000]


def test_every_module_with_a_main_is_listed():
    import re
    inside = {"__main__", "sandbox"}  # bench itself (above); the sandbox's own child process, not a command
    mains = {f"bench.{p.stem}" for p in (REPO / "bench").glob("*.py")
             if re.search(r"^def main\(", p.read_text(), re.M) and p.stem not in inside}
    assert mains <= set(MODULES), mains - set(MODULES)
