"""The manual (docs/) holds: every command it shows in a bash block runs as written (with BENCH_PARSE_ONLY=1:
it checks its arguments and composes its config, then stops; shell scripts answer --help, and their runs are
tests/test_gpu_kit.py's and tests/test_slurm.py's), every file it names exists, every page is reachable from
docs/README.md, every method and every script has its place in it, and the glossary defines each term once."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from bench.registry import decoder_configs
from helpers import REPO, run_python

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
INPUTS = ("results/reference/", "tests/fixtures/", "docs/", "adapters/", "conf/")  # paths a command reads


def commands() -> list[tuple[str, str]]:
    """(page, command line) of every line of every ```bash block in docs/."""
    return [(page.name, line.strip()) for page in PAGES
            for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)
            for line in block.strip().splitlines() if line.strip()]


def test_the_manual_shows_commands():
    assert len(commands()) > 40 and {page for page, _ in commands()} >= {"running.md", "methods.md", "scripts.md"}


@pytest.mark.slow
@pytest.mark.parametrize("page, line", commands(), ids=lambda v: v if v.endswith(".md") else v[:60])
def test_a_command_of_the_manual_runs_as_written(page, line, tmp_path):
    argv = shlex.split(line, comments=True)  # a comment after a command is bash's, not an argument
    values = [a.split("=", 1)[-1] for a in argv]
    missing = [v for v in values if v.startswith(INPUTS) and not (REPO / v).exists()]
    assert not missing, f"{page}: {line} names files that do not exist: {missing}"
    if argv[0] == "bash":
        assert argv[-1] == "--help", f"{page}: a shell script's run is its own test's; show `bash SCRIPT --help`"
        out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    else:
        assert argv[0] == "python", f"{page}: {line}: a command is python -m MODULE ... or python SCRIPT ..."
        env = dict(os.environ, BENCH_PARSE_ONLY="1")
        if any(a.startswith("hydra/launcher=slurm") for a in argv):  # the precheck asks for sbatch and srun
            fake = tmp_path / "bin"
            fake.mkdir()
            for tool in ("sbatch", "srun"):
                (fake / tool).write_text("#!/bin/sh\nexit 0\n")
                (fake / tool).chmod(0o755)
            env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
        out = run_python(*argv[1:], env=env, timeout=300)
    assert out.returncode == 0, f"{page}: {line}\n{out.stderr[-2000:]}"
    if argv[0] == "python":  # it stopped where the arguments were checked, not before
        assert "BENCH_PARSE_ONLY: the arguments are valid" in out.stdout, out.stdout[-2000:]


def test_every_link_resolves_and_every_page_is_in_the_index():
    index = (DOCS / "README.md").read_text()
    for page in PAGES:
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not link.startswith("http"):
                assert (page.parent / link).exists(), f"{page.name} links {link}, which does not exist"
        assert page.name == "README.md" or f"]({page.name})" in index, f"docs/README.md does not list {page.name}"


def test_every_method_has_its_place():
    text = (DOCS / "methods.md").read_text()
    missing = [name for name in decoder_configs() if f"`{name}`" not in text]
    assert not missing, f"docs/methods.md does not describe {missing}"


def test_every_script_is_documented():
    text = (DOCS / "scripts.md").read_text()
    scripts = sorted(p.relative_to(REPO / "scripts").as_posix() for p in (REPO / "scripts").rglob("*")
                     if p.suffix in (".py", ".sh"))
    missing = [s for s in scripts if f"`{s}`" not in text and f"`{Path(s).name}`" not in text]
    assert not missing, f"docs/scripts.md does not document {missing}"


def test_the_glossary_defines_each_term_once_in_order():
    terms = re.findall(r"^\*\*([^*]+)\*\*", (DOCS / "glossary.md").read_text(), re.M)
    assert len(terms) > 40 and len(terms) == len(set(t.lower() for t in terms)), "a term defined twice"
    assert [t.lower() for t in terms] == sorted(t.lower() for t in terms), "the glossary is not in order"
    for page in PAGES:
        if page.name != "glossary.md":  # a definition elsewhere is a second one: "**term**: ..." opening a line
            again = [t for t in re.findall(r"^\*\*([^*]+)\*\*:", page.read_text(), re.M) if t.lower() in
                     {x.lower() for x in terms}]
            assert not again, f"{page.name} defines {again} again: link the glossary instead"
