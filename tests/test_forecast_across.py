"""results/reference/forecast/cpu_cross_dtype/forecast_across.py: one leaderboard's runs priced at
another setting's profile, set beside that setting's measured speedups; the error worked out by hand,
a negative control (a wrong measured speedup is flagged), and bad input in one line with exit code 2
(no model is loaded)."""
from __future__ import annotations


import pandas as pd
import pytest

from helpers import script_module
from test_forecast import PRICES, leaderboard, write_profile

fa = script_module("results/reference/forecast/cpu_cross_dtype/forecast_across.py")

# test_forecast's hand-worked case: tree's forecast speedup at PRICES, step 10 ms
TREE = ((4 / 38 + 2 / 30) / 2) / ((4 / 52 + 2 / 26) / 2)


def measured_board(tmp_path, speedup: float):
    board = tmp_path / "measured"
    board.mkdir()
    pd.DataFrame({"decoder": ["autoregressive", "tree"], "dataset": ["ds", "ds"], "speedup": [1.0, speedup],
                  "mean_accepted_tokens": [1.0, 2.0]}).to_csv(board / "leaderboard.csv", index=False)
    return board


def test_forecast_against_the_other_settings_measured_speedup(tmp_path):
    profile, board = write_profile(tmp_path / "p", PRICES, step_ms=10.0), leaderboard(tmp_path)
    table = fa.across(board, profile, measured_board(tmp_path, TREE * 1.05), None, 0.10)
    tree = table.set_index("decoder").loc["tree"]
    assert tree["forecast_speedup"] == pytest.approx(TREE)
    assert tree["error"] == pytest.approx(1 / 1.05 - 1) and bool(tree["within"])
    # negative control: a measured speedup 20 % away is outside 10 %
    (tmp_path / "x").mkdir()
    table = fa.across(board, profile, measured_board(tmp_path / "x", TREE * 1.2), None, 0.10)
    assert not table.set_index("decoder").loc["tree", "within"]


def test_same_output_says_where_the_measured_side_decoded_other_text(tmp_path):
    """same_output: the share of a priced run's prompts whose tokens the measured run's equal; NaN
    where the measured side keeps no records (a leaderboard.csv alone)."""
    import json
    import shutil

    profile, board = write_profile(tmp_path / "p", PRICES, step_ms=10.0), leaderboard(tmp_path)
    alone = fa.across(board, profile, measured_board(tmp_path, TREE), None, 0.10).set_index("decoder")
    assert alone["same_output"].isna().all()
    measured = tmp_path / "with_records"
    shutil.copytree(board, measured)
    shutil.copy(tmp_path / "measured" / "leaderboard.csv", measured / "leaderboard.csv")
    path = measured / "ds" / "tree" / "records.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[1]["tokens"] = [7, 7]  # prompt B's text departs (as at a half-precision tie); A's holds
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    same = fa.across(board, profile, measured, None, 0.10).set_index("decoder")["same_output"]
    assert same.to_dict() == {"autoregressive": 1.0, "tree": 0.5}


def test_the_path_is_the_measured_settings_and_hf_peers_take_it_uncompiled(tmp_path):
    """The priced run ran eager; the measured one compiled (its provenance.json): the tree is priced at
    the compiled curve, an hf_* peer (transformers' generate, never compiled) at its eager twin."""
    import json

    from test_forecast import record, step, write_run

    board = leaderboard(tmp_path)
    write_run(board / "ds" / "hf_pld", [record("A", "hf_pld", [step(4, 0, 1), step(3, 4, 3)], 4),
                                       record("B", "hf_pld", [step(2, 0, 1), step(2, 2, 1)], 2)])
    profile = tmp_path / "p"
    profile.mkdir()
    pd.DataFrame({"tokens": [1, 2, 3, 4], "none_ms": [10.0, 14, 16, 18], "none+inductor_ms": [5.0, 7, 8, 9]}
                 ).to_csv(profile / "profile.csv", index=False)
    measured = measured_board(tmp_path, 1.0)
    pd.DataFrame({"decoder": ["autoregressive", "tree", "hf_pld"], "dataset": ["ds"] * 3, "speedup": [1.0] * 3,
                  "mean_accepted_tokens": [1.0, 2.0, 2.0]}).to_csv(measured / "leaderboard.csv", index=False)
    (measured / "provenance.json").write_text(json.dumps({"fast_path": "none", "compile": "inductor"}))
    sources = fa.across(board, profile, measured, None, 0.10).set_index("decoder")["target_source"]
    assert sources.to_dict() == {"autoregressive": "none+inductor", "hf_pld": "none", "tree": "none+inductor"}


@pytest.mark.parametrize("case, expected", [
    ("no_table", "cannot read"),
    ("not_a_leaderboard", "lacks decoder, dataset or speedup"),
    ("other_entries", "no (dataset, entry)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, expected):
    profile = write_profile(tmp_path / "p", PRICES, step_ms=10.0)
    measured = tmp_path / "m"
    measured.mkdir()
    if case == "not_a_leaderboard":
        pd.DataFrame({"a": [1]}).to_csv(measured / "leaderboard.csv", index=False)
    elif case == "other_entries":
        pd.DataFrame({"decoder": ["other"], "dataset": ["ds"], "speedup": [1.0],
                      "mean_accepted_tokens": [1.0]}).to_csv(measured / "leaderboard.csv", index=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        fa.main([str(leaderboard(tmp_path)), "--profile", str(profile), "--measured", str(measured),
                 "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and expected in err
    assert not out.exists()


def test_a_draft_profile_prices_the_draft(tmp_path):
    """scripts/profile_draft.py times one drafting depth of a (random) EAGLE draft on tiny-random and
    writes PROFILE/draft-<label>/profile.csv (a step's first depth), profile_later.csv (a depth
    after a depth) and step.csv (a whole step, and its host work per depth beyond the curves);
    bench.forecast then prices that entry's draft from them (n depths of draft_forward_tokens / n
    rows each: the first, then n - 1 later ones, each with the host work) instead of scaling the
    measured time."""
    import json

    profile_draft = script_module("scripts/profile_draft.py")
    from bench import forecast as fc
    from test_forecast import PROVENANCE, record, step, write_run

    profile = write_profile(tmp_path / "p", PRICES, step_ms=10.0)
    profile_draft.main([str(profile), "--labels", "eagle", "--max-tokens", "4", "--context", "4,8", "--repeats", "2",
                        "model=tiny-random", "device=cpu", "decoder.draft_weights=null", "decoder.draft_seed=1"])
    curve = pd.read_csv(profile / "draft-eagle" / "profile.csv")
    later = pd.read_csv(profile / "draft-eagle" / "profile_later.csv")
    for table in (curve, later):
        assert list(table.columns[:2]) == ["context", "tokens"] and len(table) == 8 and (table.iloc[:, 2] > 0).all()
    board = tmp_path / "board"
    write_run(board / "ds" / "eagle", [record("A", "eagle", [step(4, 0, 1), step(3, 4, 3, draft_s=0.5, draft_fed=4,
                                                                                   depth=2)], 4)])
    (board / "provenance.json").write_text(json.dumps(PROVENANCE))
    row = fc.forecast(fc.find_runs(board), fc.load_profile(profile)).iloc[0]
    steps = pd.read_csv(profile / "draft-eagle" / "step.csv").set_index("context")
    assert list(steps.index) == [4, 8] and (steps["step_ms"] > 0).all() and (steps["depths"] >= 1).all()
    assert steps["host_ms_per_depth"].notna().all() and (steps["host_ms_per_depth"] < steps["step_ms"]).all()
    assert row["draft_source"] == "profile draft-eagle (first, later depths; host work)"
    first, then = (t[(t["context"] == 4) & (t["tokens"] == 2)].iloc[0, 2] for t in (curve, later))
    host = steps.loc[4, "host_ms_per_depth"]
    # 2 depths of 2 rows after 4 cached, each with its host work; not the measured 500 ms
    assert row["draft_ms"] == pytest.approx(first + then + 2 * host)


@pytest.mark.parametrize("labels, expected", [
    ("medusa", "--labels medusa is the leaderboard entry of decoder=medusa; give entries that draft with EAGLE's"),
    ("eagle-9", "leaderboard.only: unknown label(s) ['eagle-9']"),
])
def test_profile_draft_takes_leaderboard_entries_that_draft_with_eagle(tmp_path, capsys, labels, expected):
    """Each label is profiled as its leaderboard entry runs (its own tree, size and depth); a label
    that is no entry, or one whose decoder has no EAGLE draft, is one line and exit code 2."""
    profile_draft = script_module("scripts/profile_draft.py")

    with pytest.raises(SystemExit) as e:
        profile_draft.main([str(tmp_path / "p"), "--labels", labels, "model=tiny-random", "device=cpu"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "p").exists()
