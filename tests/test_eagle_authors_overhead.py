"""results/reference/eagle_authors_overhead/eagle_authors_overhead.py, in-process at a tiny size: the
authors' own eagenerate (eagle-llm) and ours decode the same prompts with the same weights and tree, both token
for token the target's greedy output, in the same number of steps; the time split adds up; bad
input ends in one line."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from bench.errors import BenchError
from helpers import script_module

pytest.importorskip("eagle.model.ea_model", reason="eagle-llm is not installed: pip install --no-deps eagle-llm")
script = script_module("results/reference/eagle_authors_overhead/eagle_authors_overhead.py")

TINY = ["--prompts", "2", "--max-new-tokens", "12", "--prompt-len", "8", "--threads", "1"]


def test_authors_and_ours_are_lossless_on_the_same_tree(tmp_path):
    script.main([*TINY, "--split", "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "eagle_authors_overhead.csv").set_index("method")
    assert list(table.index) == ["authors (eagle-llm eagenerate)", "ours (decoder=eagle)"]
    assert table["lossless"].all()
    # the same draft, target and tree: the same accepted paths, so the same steps
    assert table["steps"].iloc[0] == table["steps"].iloc[1] > 0
    assert (table["accepted_per_step"] > 0).all()  # the copying draft is accepted
    for _, row in table.iterrows():
        assert row["overhead_ms"] == pytest.approx(row["wall_ms"] - row["target_ms"] - row["draft_ms"], abs=1e-6)
        assert row["overhead_ms"] == pytest.approx(row["drafting_ms"] + row["rest_ms"], abs=1e-6)
        assert min(row["target_ms"], row["draft_ms"], row["drafting_ms"]) > 0
        assert row["overhead_min_ms"] <= row["overhead_ms"] <= row["overhead_max_ms"]
    split = pd.read_csv(tmp_path / "eagle_authors_overhead_split.csv").set_index("region")["ms_per_step"]
    assert split["authors: evaluate_posterior"] > 0 and split["ours: loop.verify"] > 0
    assert split["ours: proposer._draft"] < table.loc["ours (decoder=eagle)", "wall_ms"]
    info = json.loads((tmp_path / "provenance.json").read_text())
    assert info["eagle_llm"] and info["torch_threads"] == 1 and info["tree"] == "mc_sim_7b_63"


def test_bad_input_is_one_line(capsys):
    with pytest.raises(BenchError, match="--prompts must be >= 1, got 0"):
        script.main(["--prompts", "0"])
    with pytest.raises(BenchError, match="--max-new-tokens must be >= 2"):
        script.main(["--max-new-tokens", "1"])
    with pytest.raises(SystemExit) as e:  # argparse's own errors end the same way
        script.main(["--fast-path", "fastest"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
