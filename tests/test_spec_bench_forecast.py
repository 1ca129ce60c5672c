"""results/reference/forecast/spec_bench_a100/spec_bench_forecast.py: a method's step priced on a
roofline and worked out by hand, a negative control that fails where a method's width or its draft is
left out, the A100 profiles' figures, and the checked-in table against the script (no model is loaded)."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from bench.forecast import Roofline, read_roofline
from helpers import script_module

sbf = script_module("results/reference/forecast/spec_bench_a100/spec_bench_forecast.py")

TARGET = sbf.Part("target", 1e9, 10, 1000, 100)  # 2 GB of float16 weights: 2 ms at 1000 GB/s
DRAFT = sbf.Part("draft", 1e8, 1, 1000, 20)
METHOD = sbf.Method("m", tau=3.0, speedup=2.0, width=8, width_source="", draft=((DRAFT, 4), (DRAFT, 4)),
                    draft_source="")


def roof(peak_flops: float = 1e14, fixed_ms: float = 0.0) -> Roofline:
    return Roofline(bandwidth_bytes_per_s=1e12, peak_flops=peak_flops, fixed_ms=fixed_ms, bytes_per_param=2)


@pytest.fixture(autouse=True)
def small_target(monkeypatch):
    monkeypatch.setattr(sbf, "TARGET", TARGET)


def test_a_step_and_the_speedup_by_hand():
    """After 100 cached tokens, at 1e14 FLOP/s every forward is bound by its weights: the target 2 ms
    whatever it is fed (8 tokens: 1.6e10 + 4 x 10 x 1000 x (800 + 36) FLOPs, 0.16 ms), the draft 0.2 ms
    a forward, twice. Speedup 3 x 2 / (2 + 0.4) = 2.5. With 1 ms per target forward, the draft's
    forward pays 1 x 20 / 100 of it: 3 x 3 / (3 + 2 x 0.4) = 2.368."""
    assert sbf.forward_ms(roof(), TARGET, 1, 100) == pytest.approx(2.0)
    assert sbf.step_ms(METHOD, roof(), 100) == pytest.approx((2.0, 0.4))
    assert sbf.forecast_speedup(METHOD, roof(), 100) == pytest.approx(2.5)
    assert sbf.step_ms(METHOD, roof(fixed_ms=1.0), 100) == pytest.approx((3.0, 0.8))
    assert sbf.forecast_speedup(METHOD, roof(fixed_ms=1.0), 100) == pytest.approx(9 / 3.8)


def test_negative_control_the_width_and_the_draft_are_priced():
    """At 1e12 FLOP/s the 8-token verification is compute-bound: 1.6033e10 FLOPs, 16.03 ms; the AR step
    2.004 ms; each draft forward 8.016e8 FLOPs, 0.8016 ms. Leaving out the width (pricing 1 token) or
    the draft would give another forecast, far from this one."""
    slow = roof(peak_flops=1e12)
    ar = (2e9 + 4e4 * 101) / 1e9
    target = (1.6e10 + 4e4 * (800 + 36)) / 1e9
    draft = 2 * (8e8 + 4e3 * (400 + 10)) / 1e9
    expected = 3 * ar / (target + draft)
    assert sbf.forecast_speedup(METHOD, slow, 100) == pytest.approx(expected)
    without_width = sbf.forecast_speedup(dataclasses.replace(METHOD, width=1), slow, 100)
    without_draft = sbf.forecast_speedup(dataclasses.replace(METHOD, draft=()), slow, 100)
    assert without_width > 2 * expected and without_draft > 1.05 * expected


def test_negative_control_on_spec_bench_methods(monkeypatch):
    """The real methods: each network draft lowers its forecast on roofline (a); on a roofline whose
    ridge is below every width but PLD's and SpS's, each method's width lowers it too."""
    monkeypatch.undo()
    a = read_roofline(sbf.PROFILES["a"]).roofline
    narrow = dataclasses.replace(a, peak_flops=a.peak_flops / 20)  # ridge at about 7 tokens
    for m in sbf.METHODS:
        if m.draft:
            assert sbf.forecast_speedup(m, a) < 0.99 * sbf.forecast_speedup(dataclasses.replace(m, draft=()), a), m
        else:
            assert sbf.forecast_speedup(m, a) == pytest.approx(m.tau)  # below the ridge verification is free
        if m.width > 11:
            assert sbf.forecast_speedup(m, narrow) < 0.9 * sbf.forecast_speedup(dataclasses.replace(m, width=1),
                                                                               narrow), m


def test_the_a100_profiles_and_the_target(monkeypatch):
    """The datasheet's figures; (b)'s fixed_ms is the H100 profile's step minus its floor (18.62 - 5.09);
    the target's matmul parameters are Vicuna-7B's 6,738,415,616 less the 32000 x 4096 input embedding."""
    monkeypatch.undo()
    a, b = (read_roofline(sbf.PROFILES[k]).roofline for k in "ab")
    for r in (a, b):
        assert (r.bandwidth_bytes_per_s, r.peak_flops, r.bytes_per_param) == (2039e9, 312e12, 2.0)
    first = pd.read_csv(sbf.H100_PROFILE).iloc[0]
    measured = first["none_ms"] / first["none_vs_own_step"] - first["none_ms"] / first["none_vs_floor"]
    assert a.fixed_ms == 0 and b.fixed_ms == pytest.approx(measured, abs=0.005)
    assert sbf.TARGET.matmul_params == 6_738_415_616 - 32000 * 4096


def test_the_checked_in_table_is_the_scripts(monkeypatch):
    monkeypatch.undo()
    rooflines = {k: read_roofline(p).roofline for k, p in sbf.PROFILES.items()}
    fresh = sbf.table(rooflines)
    stored = pd.read_csv(sbf.OUT / "forecast.csv")
    assert list(stored.columns) == list(fresh.columns) and list(stored["method"]) == list(fresh["method"])
    numeric = fresh.select_dtypes("number").columns
    pd.testing.assert_frame_equal(stored[numeric], fresh[numeric], rtol=1e-5, check_dtype=False)
    readme = (sbf.OUT / "README.md").read_text()
    for row in fresh.itertuples():
        assert f"| {row.method} | {row.spec_bench_mean_accepted_tokens} | {row.spec_bench_speedup:.2f}x | " \
               f"{row.forecast_a:.2f}x |" in readme
