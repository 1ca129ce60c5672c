"""What a user reads speaks of the product only: no tracked text file refers to the project's own issue tracker
by number (the word, a space, hyphen or #, then digits: ISSUE below), whose history a user does not have; an issue
in prose ("a known issue with ...") is left alone. This file spells its examples in pieces (WORD)."""
from __future__ import annotations

import re
import subprocess

import pytest

from helpers import REPO

ISSUE = re.compile(r"\bissues?[ -]?#?\d+", re.IGNORECASE)


def tracked_text() -> dict[str, str]:
    """Every tracked file that is text (UTF-8, no NUL byte), by path."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    texts = {}
    for path in out.decode().split("\0"):
        file = REPO / path
        if not path or not file.is_file():
            continue
        data = file.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            texts[path] = data.decode()
        except UnicodeDecodeError:
            continue
    return texts


def issue_references(texts: dict[str, str]) -> list[str]:
    return [f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
            for path, text in texts.items() for m in ISSUE.finditer(text)]


def test_no_tracked_text_refers_to_an_issue_number():
    found = issue_references(tracked_text())
    assert not found, "\n".join(found[:40])


WORD = "iss" + "ue"  # so that this file holds no reference itself


def test_the_pattern_finds_what_it_should_and_nothing_else():
    refs = {"a.md": f"as asked ({WORD} 42, item 3)\n{WORD.title()} 43, item 6: a line\n({WORD} 4/33)\n"
                    f"{WORD}s 4 and 33 #12\nsee {WORD} #7, the {WORD}-30 report"}
    assert [r.split(": ", 1)[1] for r in issue_references(refs)] == [
        f"{WORD} 42", f"{WORD.title()} 43", f"{WORD} 4", f"{WORD}s 4", f"{WORD} #7", f"{WORD}-30"]
    prose = {"b.md": "a known issue with sdpa; the issue is that 4 rows differ; tissue 3; HumanEval/0#0; PR 12"}
    assert issue_references(prose) == []
