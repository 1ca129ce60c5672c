"""bench/training/corpus.py: the self-distillation requests and the answer cache a kill can tear."""
from __future__ import annotations


import pytest

from helpers import DATA_DIR

from bench.training.corpus import append_answers, gsm8k_train_rows, read_answers, request_families, stdlib_files


def flat(families: dict[str, list[str]]) -> list[str]:
    return [t for group in families.values() for t in group]


@pytest.mark.slow
@pytest.mark.skipif(not (DATA_DIR / "gsm8k" / "train.jsonl").is_file(), reason="needs BENCH_DATA_DIR with gsm8k")
def test_extra_requests_come_last_and_leave_the_first_ones_and_their_held_out_alone():
    rows = gsm8k_train_rows(str(DATA_DIR))
    base = flat(request_families(rows, 48))
    more = request_families(rows, 48, n_functions=30, n_general=30)
    assert flat(more)[:len(base)] == base  # so every 10th of the first answers is held out as before
    assert len(more["functions"]) == 30 and len(set(more["general"])) == 30
    train_source = "".join(p.read_text(errors="ignore") for p in stdlib_files("train"))
    for task in more["functions"]:  # built from the train split's modules
        assert task.split("```python\n")[1].split("(")[0] + "(" in train_source


def test_answer_cache_keeps_every_valid_line_after_a_torn_one(tmp_path):
    path = tmp_path / "answers.jsonl"
    append_answers(path, [("a", [1, 2]), ("b", [3])])
    with open(path, "ab") as f:
        f.write(b'{"request": "c", "ids": [4')  # a writer killed mid-line
    append_answers(path, [("d", [5, 6])])  # starts on a new line: "d" is not glued to the torn one
    with open(path, "ab") as f:
        f.write(b'not json\n{"request": "e", "ids": ["x"]}\n\xff\xfe\n')
    assert read_answers(path) == {"a": [1, 2], "b": [3], "d": [5, 6]}
