"""The README is the front door: short (the manual is docs/, which it links), its two commands where
.ci/run and a newcomer find them, and what it names (files, methods, config keys) exists."""
import re

from bench.registry import decoder_configs
from helpers import REPO

README = (REPO / "README.md").read_text()
BUDGET = 6_000  # characters: an entry page, read in a minute; the manual is docs/


def test_within_budget():
    assert len(README) <= BUDGET, f"README.md has {len(README)} characters; the budget is {BUDGET}"


def test_first_screen_has_the_two_commands():
    for marker in ("<!-- run-command -->", "<!-- test-command -->"):
        after = README.split(marker, 1)[1].lstrip()
        assert after.startswith("```bash\n"), marker
        command = after.split("\n")[1]
        assert "python -m " in command and "pip install" in command, command
    assert README.index("<!-- test-command -->") < 2500  # on the first screen


def test_linked_files_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    missing = [link for link in links if not link.startswith("http") and not (REPO / link).exists()]
    assert not missing, missing


def test_named_methods_exist():
    named = set(re.findall(r"decoder=([a-z_0-9]+)", README)) | set(re.findall(r"^\| `([a-z_0-9]+)` \|", README, re.M))
    methods = set(decoder_configs())
    rows = {"decoder", "model", "dataset", "seed", "draft", "resume", "check_lossless"}  # the key table's rows
    assert not named - methods - rows, named - methods - rows
