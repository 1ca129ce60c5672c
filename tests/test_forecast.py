"""bench.forecast: a run's steps replayed at a profile's prices. Synthetic runs and profiles whose
forecasts are worked out by hand, the profile's interpolation, the roofline's arithmetic, a negative
control, the CLI's bad-input lines, and the checked-in leaderboard (no model is loaded but in the
one slow test)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pandas as pd
import pytest

from bench import forecast as fc
from helpers import REPO as ROOT, SESSION_TOKENIZER, run_python

LEADERS = ROOT / "results/reference/leaders/fp32"
CPU_PROFILE = ROOT / "results/reference/fast_path/float32"


def step(forward: int, context: int, committed: int, *, target_s: float = 0.01, draft_s: float = 0.0,
         overhead_s: float = 0.001, draft_fed: int = 0, draft_flops: float = 0.0, depth: int | None = None) -> dict:
    return {"committed": committed, "forward_tokens": forward, "context_tokens": context, "draft_tokens": 0,
            "accepted_draft_tokens": 0, "draft_forward_tokens": draft_fed, "draft_flops": draft_flops,
            "draft_prefill_flops": 0.0, "target_time": target_s, "draft_time": draft_s, "overhead_time": overhead_s,
            "info": {} if depth is None else {"draft_depth": depth}}


def record(prompt: str, decoder: str, steps: list[dict], prompt_tokens: int, **extra) -> dict:
    """A valid record of status ok whose trace is `steps`."""
    trace = {name: [s[name] for s in steps] for name in steps[0]}
    trace["position"] = [sum(trace["committed"][:i]) for i in range(len(steps))]
    n = sum(trace["committed"])
    latency = sum(trace["target_time"]) + sum(trace["draft_time"]) + sum(trace["overhead_time"])
    return {"key": f"{prompt}#0", "prompt_id": prompt, "turn": 0, "decoder": decoder, "model": "m", "dataset": "ds",
            "status": "ok", "prompt_tokens": prompt_tokens, "new_tokens": n, "steps": len(steps),
            "tokens": list(range(n)), "text": "", "trace": trace, "tokens_per_step": n / len(steps),
            "latency_s": latency, "ttft_s": trace["target_time"][0], "tokens_per_s": n / latency,
            "target_time_s": sum(trace["target_time"]), "draft_time_s": sum(trace["draft_time"]),
            "overhead_time_s": sum(trace["overhead_time"]), "forward_tokens": sum(trace["forward_tokens"]),
            "draft_tokens": 0, "accepted_draft_tokens": 0, "draft_forward_tokens": sum(trace["draft_forward_tokens"]),
            "target_flops": 1.0, "draft_flops": sum(trace["draft_flops"]), "decode_steps": len(steps) - 1,
            "decode_tokens": n - trace["committed"][0], **extra}


def write_run(directory: Path, records: list[dict]) -> Path:
    directory.mkdir(parents=True)
    (directory / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


PROVENANCE = {"device_name": "Test CPU", "dtype": "float32", "torch_threads": 2, "fast_path": "none",
              "compile": "none", "model_flops_spec": {"matmul_params": 10**9, "n_layers": 10, "d_attn": 1000}}


def leaderboard(tmp_path: Path) -> Path:
    """ds/autoregressive and ds/tree over two prompts (A: 4 prompt tokens, 4 new; B: 2 and 2)."""
    board = tmp_path / "board"
    write_run(board / "ds" / "autoregressive", [
        record("A", "autoregressive", [step(4, 0, 1), step(1, 4, 1), step(1, 5, 1), step(1, 6, 1)], 4),
        record("B", "autoregressive", [step(2, 0, 1), step(1, 2, 1)], 2)])
    write_run(board / "ds" / "tree", [
        record("A", "tree", [step(4, 0, 1), step(3, 4, 3, draft_s=0.002)], 4),  # 2 drafts accepted, + bonus
        record("B", "tree", [step(2, 0, 1), step(2, 2, 1)], 2)])  # its draft rejected
    (board / "provenance.json").write_text(json.dumps(PROVENANCE))
    return board


def write_profile(directory: Path, rows: dict[int, float], step_ms: float | None = None, *, path: str = "none",
                  info: dict | None = None, context: int | None = None) -> Path:
    """A profile_device-style profile.csv: <path>_ms by tokens; <path>_vs_own_step where step_ms is given."""
    directory.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame({"tokens": list(rows), f"{path}_ms": list(rows.values())})
    if step_ms is not None:
        table[f"{path}_vs_own_step"] = table[f"{path}_ms"] / step_ms
    if context is not None:
        table.insert(0, "context", context)
    table.to_csv(directory / "profile.csv", index=False)
    (directory / "provenance.json").write_text(json.dumps(info if info is not None else {"device_name": "Other"}))
    return directory


# k = 1 is the autoregressive step (12 ms / 1.2), not the masked one-token row
PRICES = {1: 12.0, 2: 14.0, 3: 16.0, 4: 18.0}


def run_forecast(board: Path, profile: Path, **kw) -> pd.DataFrame:
    return fc.forecast(fc.find_runs(board), fc.load_profile(profile), **kw).set_index("run")


def test_a_forecast_worked_out_by_hand(tmp_path):
    """Per step: the profile's ms for (forward tokens) + the draft's measured host time + the run's own
    overhead (1 ms a step). autoregressive A: 18 (prefill of 4) + 3 x 10 (one-token steps) + 4 = 52 ms;
    B: 14 + 10 + 2 = 26 ms. tree A: 18 + 16 (3 tokens) + 2 (draft) + 2 = 38 ms; B: 14 + 14 + 2 = 30 ms.
    Speedup is Spec-Bench's: the mean of per-prompt tokens/s over the reference's mean."""
    table = run_forecast(leaderboard(tmp_path), write_profile(tmp_path / "p", PRICES, step_ms=10.0))
    ar, tree = table.loc["autoregressive"], table.loc["tree"]
    assert ar["forecast_speedup"] == pytest.approx(1.0)
    assert ar["forecast_tokens_per_s"] == pytest.approx(6 / (0.052 + 0.026))
    assert tree["forecast_speedup"] == pytest.approx(((4 / 38 + 2 / 30) / 2) / ((4 / 52 + 2 / 26) / 2))
    assert tree["forecast_tokens_per_s"] == pytest.approx(6 / (0.038 + 0.030))
    # per decoding step (prefill out): tree's 16 and 14 ms forwards, the 2 ms draft once, 1 ms overhead
    assert (tree["target_ms"], tree["draft_ms"], tree["overhead_ms"]) == pytest.approx((15.0, 1.0, 1.0))
    assert tree["step_ms"] == pytest.approx(17.0) and tree["ar_step_ms"] == pytest.approx(11.0)
    assert ar["target_ms"] == pytest.approx(10.0)
    assert tree["reference"] == "autoregressive entry" and tree["target_source"] == "none"
    assert tree["draft_source"].startswith("none")  # no draft forwards: host work as measured
    # timed on "Test CPU", profiled on "Other": nothing measured to set beside it
    assert pd.isna(tree["measured_speedup"]) and pd.isna(tree["measured_tokens_per_s"])


def test_without_an_autoregressive_entry_the_reference_is_one_token_steps(tmp_path):
    """A lone run: its reference is the prompt's prefill then one token a step, without overhead
    (A: 18 + 3 x 10 = 48 ms; B: 14 + 10 = 24 ms)."""
    board = leaderboard(tmp_path)
    import shutil

    shutil.rmtree(board / "ds" / "autoregressive")
    tree = run_forecast(board / "ds" / "tree", write_profile(tmp_path / "p", PRICES, step_ms=10.0)).loc["tree"]
    assert tree["reference"] == "one-token steps"
    assert tree["forecast_speedup"] == pytest.approx(((4 / 38 + 2 / 30) / 2) / ((4 / 48 + 2 / 24) / 2))


def test_measured_speedup_only_on_the_profiles_device(tmp_path):
    board = leaderboard(tmp_path)
    here = {k: PROVENANCE[k] for k in ("device_name", "dtype", "torch_threads")}
    tree = run_forecast(board, write_profile(tmp_path / "p", PRICES, step_ms=10.0, info=here)).loc["tree"]
    # measured: A 4 / (0.02 + 0.002 + 0.002) and 4 / 0.044, B 2 / 0.022 and 2 / 0.022 (10 ms forwards, 1 ms overhead)
    assert tree["measured_speedup"] == pytest.approx(((4 / 24 + 2 / 22) / 2) / ((4 / 44 + 2 / 22) / 2))
    assert tree["measured_tokens_per_s"] == pytest.approx(6 / 0.046)
    assert tree["measured_draft_ms"] == pytest.approx(2 / 2)  # A's 2 ms of draft over the two decoding steps
    other_threads = {**here, "torch_threads": 4}
    tree = run_forecast(board, write_profile(tmp_path / "q", PRICES, step_ms=10.0, info=other_threads)).loc["tree"]
    assert pd.isna(tree["measured_speedup"]) and pd.isna(tree["measured_draft_ms"])


def test_the_profile_is_interpolated_in_tokens_and_context(tmp_path):
    """Between profiled sizes linearly, past the largest along the upper half's line (step_cost), and
    between profiled contexts linearly, outside them at the nearest."""
    curve = fc.read_curves(write_profile(tmp_path / "k", {1: 10.0, 2: 14.0, 4: 22.0}) / "profile.csv")["none"]
    assert curve.forward_ms(3, 0) == pytest.approx(18.0)
    assert curve.forward_ms(2.5, 0) == pytest.approx(16.0)
    assert curve.forward_ms(6, 0) == pytest.approx(22.0 + 2 * 4.0)  # slope of k = 3..4
    (tmp_path / "c").mkdir()
    pd.DataFrame({"context": [100, 100, 300, 300], "tokens": [1, 2, 1, 2], "none_ms": [10.0, 20.0, 14.0, 28.0]}
                 ).to_csv(tmp_path / "c" / "profile.csv", index=False)
    curve = fc.read_curves(tmp_path / "c" / "profile.csv")["none"]
    assert curve.forward_ms(2, 200) == pytest.approx(24.0)
    assert curve.forward_ms(1, 250) == pytest.approx(13.0)
    assert curve.forward_ms(2, 50) == pytest.approx(20.0) and curve.forward_ms(2, 900) == pytest.approx(28.0)


def test_the_one_token_cost_is_the_autoregressive_step(tmp_path):
    """<path>_ms / <path>_vs_own_step at k = 1: the causal step the baseline takes (10 ms), not the
    masked one-token forward of the profile's first row (12 ms); without the column, the row."""
    with_step = fc.read_curves(write_profile(tmp_path / "a", PRICES, step_ms=10.0) / "profile.csv")["none"]
    without = fc.read_curves(write_profile(tmp_path / "b", PRICES) / "profile.csv")["none"]
    assert with_step.forward_ms(1, 0) == pytest.approx(10.0) and without.forward_ms(1, 0) == pytest.approx(12.0)
    assert with_step.forward_ms(3, 0) == pytest.approx(16.0)


def write_roofline(path: Path, **keys) -> Path:
    values = {"device": "Roof", "bandwidth_gb_s": 1000, "peak_flops": "1e14", "fixed_ms": 0.01, "bytes_per_param": 2}
    path.write_text("".join(f"{k}: {v}\n" for k, v in {**values, **keys}.items() if v is not None))
    return path


def test_roofline_arithmetic(tmp_path):
    """1e9 matmul parameters at 2 bytes over 1000 GB/s: 2 ms of weights per forward. One token after
    100: 2e9 + 4 x 10 layers x 1000 x 101 FLOPs, 0.02 ms at 1e14/s, so the weights bound it: 2.01 ms
    with the fixed 0.01. A prefill of 200 tokens: 4e11 + 4e4 x 20100 FLOPs = 4.00804 ms: compute-bound.
    A draft step of 2 levels, 10 tokens fed, 2e8 FLOPs: the draft has 1e7 parameters (2e8 / (2 x 10)),
    each forward max(2e7 B / 1e12 B/s, 1e8 / 1e14) + 0.01 = 0.03 ms, twice."""
    board = leaderboard(tmp_path)
    write_run(board / "ds" / "drafted", [
        record("A", "drafted", [step(4, 0, 1), step(3, 4, 3, draft_fed=10, draft_flops=2e8, depth=2)], 4)])
    profile = fc.load_profile(write_roofline(tmp_path / "roof.yaml"))
    runs = {run.label: run for run in fc.find_runs(board)}
    prices = fc.add_draft_prices(fc.target_prices(runs["drafted"], profile, None), runs["drafted"], profile, None)
    assert prices.target_ms(1, 100) == pytest.approx(2.01)
    assert prices.target_ms(200, 0) == pytest.approx(4.00804 + 0.01)
    assert prices.draft_source == "roofline (10M params)"
    assert prices.draft_ms(runs["drafted"].records[0]["trace"], 1) == pytest.approx(0.06)
    table = fc.forecast(list(runs.values()), profile).set_index("run")
    assert table.loc["drafted", "draft_ms"] == pytest.approx(0.06)
    assert table.loc["drafted", "target_source"] == "roofline"


def test_draft_cost_from_the_profiles_draft_curve_else_measured_and_scaled(tmp_path):
    """PROFILE/draft-<label>/ prices each of the step's draft forwards (3 levels, 6 tokens fed: 3 x
    the 2-token cost, 2 ms); with its profile_later.csv too, the first depth at profile.csv's 2-token
    cost and the two later ones at profile_later.csv's (2/3 + 2 x 0.4 ms), and with its step.csv
    each of the three depths also pays the host work it gives. Without any of them, the
    measured 5 ms scaled by the target's forecast over measured decoding time (14 ms forecast for the
    2-token step, 28 ms measured: x 0.5)."""
    board = tmp_path / "board"
    write_run(board / "ds" / "drafted", [record("A", "drafted", [
        step(2, 0, 1), step(2, 2, 2, target_s=0.028, draft_s=0.005, draft_fed=6, draft_flops=1e6, depth=3)], 2)])
    profile_dir = write_profile(tmp_path / "p", PRICES, step_ms=10.0)
    scaled = run_forecast(board, profile_dir).loc["drafted"]
    assert scaled["draft_source"] == "measured x 0.5" and scaled["draft_ms"] == pytest.approx(2.5)
    write_profile(profile_dir / "draft-drafted", {1: 0.5, 2: 2 / 3, 3: 1.0})
    drafted = run_forecast(board, profile_dir).loc["drafted"]
    assert drafted["draft_source"] == "profile draft-drafted" and drafted["draft_ms"] == pytest.approx(2.0)
    # a compiled target path asked for: the draft, never compiled, takes its profile's uncompiled curve
    write_profile(profile_dir, PRICES, step_ms=10.0, path="none+inductor")
    compiled = run_forecast(board, profile_dir, fast_path="none+inductor").loc["drafted"]
    assert compiled["draft_source"] == "profile draft-drafted" and compiled["draft_ms"] == pytest.approx(2.0)
    later = write_profile(tmp_path / "later", {1: 0.3, 2: 0.4, 3: 0.5}) / "profile.csv"
    later.rename(profile_dir / "draft-drafted" / "profile_later.csv")
    split = run_forecast(board, profile_dir).loc["drafted"]
    assert split["draft_source"] == "profile draft-drafted (first, later depths)"
    assert split["draft_ms"] == pytest.approx(2 / 3 + 2 * 0.4)
    # step.csv's host work a depth, interpolated in context (the step drafted after 2 cached positions)
    (profile_dir / "draft-drafted" / "step.csv").write_text("context,host_ms_per_depth\n0,0.1\n4,0.3\n")
    hosted = run_forecast(board, profile_dir).loc["drafted"]
    assert hosted["draft_source"] == "profile draft-drafted (first, later depths; host work)"
    assert hosted["draft_ms"] == pytest.approx(2 / 3 + 2 * 0.4 + 3 * 0.2)


def test_negative_control_slower_verification_hurts_the_tree_not_autoregressive(tmp_path):
    """A profile twice as slow for k > 1 only: the tree method's forecast speedup falls; autoregressive's
    decoding step and its speedup (1.0) do not move. Pricing the same profile again moves nothing."""
    board = leaderboard(tmp_path)
    base = run_forecast(board, write_profile(tmp_path / "p", PRICES, step_ms=10.0))
    slow = run_forecast(board, write_profile(tmp_path / "q", {k: v * (2 if k > 1 else 1) for k, v in PRICES.items()},
                                             step_ms=10.0))
    assert slow.loc["tree", "forecast_speedup"] < base.loc["tree", "forecast_speedup"] - 0.2
    assert slow.loc["autoregressive", "forecast_speedup"] == pytest.approx(1.0)
    assert slow.loc["autoregressive", "target_ms"] == base.loc["autoregressive", "target_ms"] == pytest.approx(10.0)
    again = run_forecast(board, write_profile(tmp_path / "r", PRICES, step_ms=10.0))
    assert again.loc["tree", "forecast_speedup"] == base.loc["tree", "forecast_speedup"]


def test_the_fast_path_is_the_runs_else_asked_for(tmp_path):
    board = leaderboard(tmp_path)
    profile_dir = tmp_path / "p"
    profile_dir.mkdir()
    pd.DataFrame({"tokens": [1, 2, 3, 4], "none_ms": [10.0, 14, 16, 18], "prepacked>=4_ms": [5.0, 7, 8, 9]}
                 ).to_csv(profile_dir / "profile.csv", index=False)
    assert run_forecast(board, profile_dir).loc["tree", "target_source"] == "none"  # PROVENANCE's fast path
    picked = run_forecast(board, profile_dir, fast_path="prepacked>=4").loc["tree"]
    assert picked["target_source"] == "prepacked>=4" and picked["target_ms"] == pytest.approx((8 + 7) / 2)


def test_a_kernel_run_takes_the_kernel_curve(tmp_path):
    curves = dict.fromkeys(["none", "prepacked>=1", "kernel", "kernel+inductor"])
    assert fc.pick_path(curves, {"fast_path": "kernel", "dtype": "float32"}, None, tmp_path) == "kernel"
    compiled = {"fast_path": "kernel", "dtype": "float32", "compile": "inductor"}
    assert fc.pick_path(curves, compiled, None, tmp_path) == "kernel+inductor"
    assert fc.pick_path(curves, compiled, None, tmp_path, compiled=False) == "kernel"


def test_transformers_generate_is_priced_at_the_eager_curve_in_a_compiled_run(tmp_path):
    """hf_* peers call the model's own forward, never the compiled step: a compiled leaderboard's
    hf_pld entry takes the run's fast path uncompiled, its other entries the compiled curve."""
    board = leaderboard(tmp_path)
    write_run(board / "ds" / "hf_pld", [
        record("A", "hf_pld", [step(4, 0, 1), step(3, 4, 3)], 4),
        record("B", "hf_pld", [step(2, 0, 1), step(2, 2, 1)], 2)])
    (board / "provenance.json").write_text(json.dumps({**PROVENANCE, "compile": "inductor"}))
    profile_dir = tmp_path / "p"
    profile_dir.mkdir()
    pd.DataFrame({"tokens": [1, 2, 3, 4], "none_ms": [10.0, 14, 16, 18], "none+inductor_ms": [5.0, 7, 8, 9]}
                 ).to_csv(profile_dir / "profile.csv", index=False)
    table = run_forecast(board, profile_dir)
    assert table.loc["tree", "target_source"] == "none+inductor" and table.loc["hf_pld", "target_source"] == "none"
    assert table.loc["hf_pld", "target_ms"] == pytest.approx((16 + 14) / 2)


def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        fc.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize("case, expected", [
    ("no run dir", "does not exist; give a run directory"),
    ("no records", "no run directories (with records.jsonl"),
    ("no profile", "no-profile does not exist; give a directory written by scripts/profile_device.py"),
    ("profile without profile.csv", "holds no profile.csv"),
    ("profile without a tokens column", "needs a tokens column and a <path>_ms column"),
    ("profile with a bad value", "column none_ms must hold numbers > 0"),
    ("roofline lacking a key", "lacks peak_flops; a roofline file gives device, bandwidth_gb_s, peak_flops"),
    ("roofline with a bad value", "bandwidth_gb_s must be a number > 0, not 'fast'"),
    ("roofline with an unknown key", "has unknown key bandwith_gb_s"),
    ("roofline without the run's model", "needs the target's model_flops_spec"),
    ("roofline whose peak is 1e-300 FLOP/s", "prices a forward of"),  # inf ms, then nan and 0 tok/s: exit 0
    ("a fast path the profile lacks", "--path prepacked is not in"),
    ("a draft's step.csv without host work", "needs context and host_ms_per_depth columns"),
    ("a draft's step.csv with a bad value", "column host_ms_per_depth must hold numbers in every row"),
    ("an --out holding other files", "holds more than a forecast"),
])
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys, case, expected):
    board = leaderboard(tmp_path)
    profile = write_profile(tmp_path / "p", PRICES, step_ms=10.0)
    out = tmp_path / "out"
    args = [board, "--profile", profile, "--out", out]
    if case == "no run dir":
        args[0] = tmp_path / "nowhere"
    elif case == "no records":
        (tmp_path / "empty").mkdir()
        args[0] = tmp_path / "empty"
    elif case == "no profile":
        args[2] = tmp_path / "no-profile"
    elif case == "profile without profile.csv":
        (profile / "profile.csv").unlink()
    elif case == "profile without a tokens column":
        (profile / "profile.csv").write_text("k,none_ms\n1,10\n")
    elif case == "profile with a bad value":
        (profile / "profile.csv").write_text("tokens,none_ms\n1,10\n2,-3\n")
    elif case == "roofline lacking a key":
        args[2] = write_roofline(tmp_path / "roof.yaml", peak_flops=None)
    elif case == "roofline with a bad value":
        args[2] = write_roofline(tmp_path / "roof.yaml", bandwidth_gb_s="fast")
    elif case == "roofline with an unknown key":
        args[2] = write_roofline(tmp_path / "roof.json", bandwith_gb_s=1)
    elif case == "roofline without the run's model":
        (board / "provenance.json").unlink()
        args[2] = write_roofline(tmp_path / "roof.yaml")
    elif case == "roofline whose peak is 1e-300 FLOP/s":
        args[2] = write_roofline(tmp_path / "roof.yaml", peak_flops=1e-300)
    elif case == "a fast path the profile lacks":
        args += ["--path", "prepacked"]
    elif case.startswith("a draft's step.csv"):
        write_profile(profile / "draft-tree", {1: 0.5, 2: 1.0})
        bad = "context,step_ms\n64,3\n" if "without" in case else "context,host_ms_per_depth\n64,fast\n"
        (profile / "draft-tree" / "step.csv").write_text(bad)
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    code, stdout, err = cli(capsys, *args)
    assert code == 2 and stdout == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert not out.exists() or [p.name for p in out.iterdir()] == ["notes.txt"]


def test_the_cli_prints_and_writes_the_table(tmp_path, capsys):
    board = leaderboard(tmp_path)
    fc.main([str(board), "--profile", str(write_profile(tmp_path / "p", PRICES, step_ms=10.0)),
             "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert "| tree" in out and "Forecast of" in out and "forecast.csv" in err
    rows = list(csv.DictReader(open(tmp_path / "out" / "forecast.csv")))
    assert [r["run"] for r in rows] == ["autoregressive", "tree"]
    assert (tmp_path / "out" / "forecast.md").read_text().startswith("Forecast of")


def test_the_checked_in_leaderboard_on_a_cpu_profile():
    """The fp32 leaders (SmolLM2-135M, 2 threads on a Sapphire Rapids Xeon) priced by the float32
    fast-path profile of that kind of CPU (same device name, dtype and threads): every entry gets a
    forecast, autoregressive's is 1.0, and measured_speedup is the leaderboard's own figure."""
    table = run_forecast(LEADERS / "humaneval", CPU_PROFILE)
    board = pd.read_csv(LEADERS / "leaderboard.csv")
    board = board[board["dataset"] == "humaneval"].set_index("decoder")
    assert set(table.index) == set(board.index) and len(table) == 10
    assert table.loc["autoregressive", "forecast_speedup"] == pytest.approx(1.0)
    assert (table["target_source"] == "prepacked").all()  # the run's path: packed from 4 rows, the default
    for label, row in table.iterrows():
        assert row["measured_speedup"] == pytest.approx(board.loc[label, "speedup"]), label
        assert 0.1 < row["forecast_speedup"] < 10 and row["forecast_tokens_per_s"] > 0
    assert table.loc["eagle", "draft_source"].startswith("measured x")


@pytest.mark.slow
@pytest.mark.parametrize("how", [["--repeats", "1"], ["--interleave", "2"]], ids=["fastest", "interleaved"])
def test_a_profile_of_two_contexts_prices_a_run(tmp_path, how):
    """scripts/profile_device.py --context 8,16 writes a block per context (a context column), as the
    fastest of --repeats or as medians of --interleave rounds; the forecast reads it, and python -m
    bench.forecast runs end to end."""
    out = run_python("scripts/profile_device.py", "--max-tokens", "3", *how, "--context", "8,16", "--paths", "none",
                     "--out", tmp_path / "prof", "model=tiny-random", f"cache_dir={tmp_path}", *SESSION_TOKENIZER,
                     "device=cpu", cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "prof" / "profile.csv")))
    assert [(r["context"], r["tokens"]) for r in rows] == [(c, k) for c in ("8", "16") for k in ("1", "2", "3")]
    if "--interleave" in how:  # each context's medians, and its fastest round beside them
        assert all(float(r["none_min_ms"]) <= float(r["none_ms"]) for r in rows)
    assert json.loads((tmp_path / "prof" / "provenance.json").read_text())["contexts"] == [8, 16]
    assert sorted(fc.read_curves(tmp_path / "prof" / "profile.csv")["none"].ms_by_context) == [8, 16]
    if "--interleave" in how:
        return  # the same table as the other case's: its end to end run is that case's
    board = leaderboard(tmp_path)
    run = run_python("-m", "bench.forecast", board, "--profile", tmp_path / "prof", "--out", tmp_path / "out",
                     cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    table = pd.read_csv(tmp_path / "out" / "forecast.csv").set_index("run")
    assert table.loc["autoregressive", "forecast_speedup"] == pytest.approx(1.0)


def test_a_steps_draft_forwards_are_its_own_count_else_its_trees_depth():
    """EAGLE's drafting can go deeper than the tree it keeps: draft_forwards, where the step records
    it, is what the draft is priced by; else draft_depth; else one; none where nothing was fed."""
    trace = {"draft_forward_tokens": [0, 6, 6, 6, 0],
             "info": [{}, {"draft_depth": 2, "draft_forwards": 3}, {"draft_depth": 2}, {}, {"draft_depth": 2}]}
    assert [fc.draft_forwards(trace, i) for i in range(5)] == [0, 3, 2, 1, 0]
