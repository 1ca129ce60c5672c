"""A run's check that the machine's speed held (bench/drift.py)."""
import time

import pytest

from bench import drift
from helpers import tiny_lm


def test_compare_flags_a_change_beyond_the_bound_either_way():
    assert drift.compare(10.0, 10.9)["drifted"] is False
    assert drift.compare(10.0, 11.2) == pytest.approx({"start_ms": 10.0, "end_ms": 11.2, "change": 0.12,
                                                       "bound": drift.DRIFT_BOUND, "drifted": True})
    assert drift.compare(10.0, 8.5)["drifted"] is True  # faster counts too
    assert drift.warning(drift.compare(10.0, 10.5), "the run") is None
    line = drift.warning(drift.compare(40.0, 50.0), "the run")
    assert "40.0 ms before the run and 50.0 ms after (+25%, beyond +-10%)" in line


def test_step_ms_times_the_one_token_step_and_sees_a_slower_machine(monkeypatch):
    """Made 200 ms slower per forward (the negative control: a machine that slowed down), the step
    takes at least those 200 ms and compare() says the run drifted."""
    lm = tiny_lm(seed=0)
    first = drift.step_ms(lm)
    assert 0 < first < 100
    forward = lm.forward

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return forward(*args, **kwargs)
    monkeypatch.setattr(lm, "forward", slow)
    slower = drift.step_ms(lm)
    assert slower >= 200
    assert drift.compare(first, slower)["drifted"]


def test_a_run_keeps_the_check_in_provenance_and_says_when_it_drifted(tmp_path, capsys):
    import json

    from bench.runner import keep_reference_step

    (tmp_path / "provenance.json").write_text(json.dumps({"git_commit": "abc"}))
    keep_reference_step(tmp_path, drift.compare(10.0, 10.5))
    kept = json.loads((tmp_path / "provenance.json").read_text())
    assert kept["git_commit"] == "abc" and kept["reference_step"]["end_ms"] == 10.5
    assert capsys.readouterr().err == ""
    keep_reference_step(tmp_path, drift.compare(10.0, 13.0))
    assert json.loads((tmp_path / "provenance.json").read_text())["reference_step"]["drifted"] is True
    assert "10.0 ms before the run's timed prompts and 13.0 ms after (+30%" in capsys.readouterr().err


def test_prompt_step_ms_is_an_autoregressive_runs_time_after_the_prefill_per_step():
    assert drift.prompt_step_ms({"latency_s": 1.0, "ttft_s": 0.1, "steps": 10}) == pytest.approx(100.0)
    assert drift.prompt_step_ms({"latency_s": 1.0, "ttft_s": 1.0, "steps": 1}) is None  # the prefill alone
    assert drift.prompt_step_ms({"latency_s": 1.0, "steps": 10}) is None


def test_spread_flags_a_reference_that_moved_between_prompts():
    """The probes before and after can both land in fast stretches; the reference's own step on each
    prompt cannot (the fp32 leaders of results/reference/leaders/eager_zen4/ on MT-Bench: 18.3-23.6 ms,
    with probes of 18.4 and 18.8)."""
    held = drift.spread([18.3, 19.2, 18.9, None])  # a prompt without a reference step is left out
    assert held.pop("prompt_step_ms") == [18.3, 19.2, 18.9]
    assert held == pytest.approx({"fastest_ms": 18.3, "slowest_ms": 19.2, "change": 19.2 / 18.3 - 1,
                                  "bound": drift.DRIFT_BOUND, "drifted": False})
    moved = drift.spread([19.2, 22.9, 23.0, 23.6, 18.3])
    assert moved["drifted"] and moved["change"] == pytest.approx(23.6 / 18.3 - 1)
    assert drift.spread([20.0]) is None and drift.spread([]) is None
    assert drift.warning_during(held, "mt_bench's timed prompts") is None
    line = drift.warning_during(moved, "mt_bench's timed prompts")
    assert "ranged from 18.3 to 23.6 ms over mt_bench's timed prompts (+29%, beyond 10%)" in line


def test_a_run_says_when_its_reference_moved_between_prompts(tmp_path, capsys):
    import json

    from bench.runner import keep_reference_step

    (tmp_path / "provenance.json").write_text(json.dumps({}))
    keep_reference_step(tmp_path, {**drift.compare(10.0, 10.2), "during": drift.spread([10.0, 10.5])})
    assert capsys.readouterr().err == ""
    keep_reference_step(tmp_path, {**drift.compare(10.0, 10.2), "during": drift.spread([10.0, 13.0])})
    assert json.loads((tmp_path / "provenance.json").read_text())["reference_step"]["during"]["drifted"] is True
    err = capsys.readouterr().err
    assert "ranged from 10.0 to 13.0 ms over the run's timed prompts (+30%" in err and "before the run" not in err
