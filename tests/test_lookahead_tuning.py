"""Hardware-aware lookahead: the latency profile, the predicted-speedup choice, its caches,
and `auto` W/N/G through the runner."""
import json

import pandas as pd
import pytest

import decoders.tuning.lookahead_tuning as tuning
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.lookahead import Lookahead
from decoders.tuning.profile import forward_latency, profile_key, step_cost
from decoders.core.sampling import Sampling
from helpers import SESSION_TOKENIZER, run_cli, tiny_lm

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 1, 2, 9, 1]]


def test_step_cost_interpolates_and_extrapolates():
    profile = {"latency_s": [2.0, 3.0, 4.0, 5.0], "autoregressive_s": 1.0}
    assert step_cost(profile, 1) == 2.0  # a masked 1-token forward vs the plain autoregressive step
    assert step_cost(profile, 2.5) == pytest.approx(3.5)
    assert step_cost(profile, 4) == pytest.approx(5.0)
    assert step_cost(profile, 10) == pytest.approx(11.0)  # slope of the upper half, 1 per token
    bent = {"latency_s": [1.0, 1.0, 1.0, 1.0, 3.0, 5.0, 7.0, 9.0], "autoregressive_s": 1.0}  # flat, then 2 a token
    assert step_cost(bent, 10) == pytest.approx(13.0)  # the upper half's line, not one fitted to the flat start
    falling = {"latency_s": [2.0, 3.0, 5.0, 4.0], "autoregressive_s": 1.0}  # a noisy last size
    assert step_cost(falling, 6) == pytest.approx(4.0)  # more tokens never cost less: no downward slope


def test_profile_is_measured_once_then_cached(tmp_path, monkeypatch):
    lm = tiny_lm(seed=1)
    first = forward_latency(lm, tmp_path, max_tokens=6, context=16, repeats=2)
    assert len(first["latency_s"]) == 6 and all(t > 0 for t in first["latency_s"]) and first["autoregressive_s"] > 0
    assert (tmp_path / "latency" / f"{profile_key(lm)}.json").is_file()
    monkeypatch.setattr("decoders.tuning.profile.measure_forward_latency",
                        lambda *a, **k: pytest.fail("measured again"))
    assert forward_latency(lm, tmp_path, max_tokens=6, context=16) == first
    assert forward_latency(lm, tmp_path, max_tokens=4, context=16) == first  # a longer profile serves shorter asks


def test_profile_key_separates_models_and_threads():
    a, b = tiny_lm(seed=0), tiny_lm(seed=0, layers=3)
    assert profile_key(a) != profile_key(b)
    assert "threads" in profile_key(a)


def runner(lm):
    """What Lookahead.prepare hands tune(): lookahead with one grid point's W, N, G."""
    return lambda ids, tokens, sampling, w, n, g: Lookahead(window=w, ngram=n, guess_set_size=g).generate(
        lm, ids, tokens, sampling, set())


def fake_profile(monkeypatch, per_token: float):
    """A device where a forward of k tokens costs 1 + per_token * (k - 1) autoregressive steps."""
    profile = {"key": f"fake-{per_token}", "autoregressive_s": 0.01,
               "latency_s": [0.01 * (1 + per_token * k) for k in range(64)]}
    monkeypatch.setattr(tuning, "forward_latency", lambda *a, **k: profile)


@pytest.mark.slow
@pytest.mark.parametrize("per_token", [0.0, 0.05, 1.0])
def test_choice_maximises_compression_over_step_cost(monkeypatch, tmp_path, per_token):
    fake_profile(monkeypatch, per_token)
    lm = tiny_lm(seed=2)
    out = tuning.tune(lm, PROMPTS, set(), window="auto", ngram="auto", guess_set_size="auto", windows=(1, 3, 5),
                      ngrams=(2, 3, 4), tokens=24, run=runner(lm),
                      cache_dir=tmp_path)
    table = pd.DataFrame(out["table"])
    assert len(table) == 9 and (table["guess_set_size"] == table["window"]).all()  # G follows W
    expected_cost = 1 + per_token * (table["forward_tokens"] - 1)
    assert table["step_cost"].to_numpy() == pytest.approx(expected_cost.to_numpy())
    best = table.loc[(table["compression"] / expected_cost).idxmax()]
    assert (out["window"], out["ngram"]) == (best["window"], best["ngram"])
    assert out["predicted_speedup"] == pytest.approx(
        best["compression"] / (1 + per_token * (best["forward_tokens"] - 1)))
    if per_token == 0.0:  # free extra tokens: the most compressive setting wins
        assert best["compression"] == table["compression"].max()
    if per_token == 1.0:  # every token costs a full step: nothing beats W=1, N=2
        assert out["predicted_speedup"] <= 1.0 + 1e-9


def test_compression_table_is_cached_and_fixed_parameters_are_kept(monkeypatch, tmp_path):
    fake_profile(monkeypatch, 0.05)
    lm = tiny_lm(seed=3)
    first = tuning.tune(lm, PROMPTS, set(), window="auto", ngram=3, guess_set_size=2, windows=(1, 2, 4),
                        ngrams=(2, 5), tokens=16, run=runner(lm),
                        cache_dir=tmp_path)
    assert {(r["ngram"], r["guess_set_size"]) for r in first["table"]} == {(3, 2)}  # only W searched
    assert [r["window"] for r in first["table"]] == [1, 2, 4]
    again = tuning.tune(lm, PROMPTS, set(), window="auto", ngram=3, guess_set_size=2, windows=(1, 2, 4),
                        ngrams=(2, 5), tokens=16,
                        run=lambda *a: pytest.fail("calibrated again"), cache_dir=tmp_path)
    assert again["window"] == first["window"] and again["table"] == first["table"]


def test_auto_decoder_is_exact_and_reports_its_choice(monkeypatch):
    fake_profile(monkeypatch, 0.05)
    lm = tiny_lm(seed=4)
    decoder = Lookahead(window="auto", ngram="auto", guess_set_size="auto", auto_windows=(2, 4), auto_ngrams=(2, 3),
                        auto_tokens=12, auto_prompts=2)
    assert decoder.calibration_prompts == 2
    decoder.prepare(lm, PROMPTS, set())
    assert decoder.calibration_prompts == 0 and (
        decoder.tuning["window"], decoder.tuning["ngram"],
        decoder.tuning["guess_set_size"]) in {(w, n, w) for w in (2, 4) for n in (2, 3)}
    for prompt in PROMPTS:
        out = decoder.generate(lm, prompt, 30, Sampling(), set())
        assert out.tokens == autoregressive_decode(lm, prompt, 30, Sampling(), set()).tokens


@pytest.mark.slow
def test_auto_through_the_runner_records_choice_and_prediction(tmp_path):
    run = tmp_path / "run"
    out = run_cli("model=tiny-random", "gen.max_new_tokens=12", "dataset.limit=3", "decoder=lookahead",
                  "decoder.window=auto", "decoder.ngram=auto", "decoder.auto_windows=[1,3]",
                  "decoder.auto_ngrams=[2,3]",
                  "decoder.auto_tokens=8", "check_lossless=true", f"cache_dir={tmp_path / 'cache'}", *SESSION_TOKENIZER,
                  f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    tuned = records[0]["tuned"]
    assert tuned["window"] in (1, 3) and tuned["ngram"] in (2, 3) and tuned["guess_set_size"] == tuned["window"]
    assert all(r["tuned"] == tuned and r["lossless"] for r in records)
    summary = pd.read_csv(run / "summary.csv")
    assert summary.loc[0, "predicted_speedup"] == pytest.approx(tuned["predicted_speedup"])
    assert "speedup" in summary.columns  # measured, beside the prediction
    assert (list((tmp_path / "cache" / "latency").glob("*.json"))
            and list((tmp_path / "cache" / "tuning").glob("*.json")))


def test_calibration_runs_at_the_runs_sampling_settings(monkeypatch, tmp_path):
    """Compression at T > 0 is not greedy compression: the tuner decodes with the run's settings,
    and caches them apart."""
    fake_profile(monkeypatch, 0.05)
    from decoders.methods import lookahead

    seen = []
    real = lookahead.Lookahead.generate

    def spy(self, lm, ids, tokens, sampling, stop_ids):
        seen.append(sampling)
        return real(self, lm, ids, tokens, sampling, stop_ids)

    monkeypatch.setattr(lookahead.Lookahead, "generate", spy)
    lm = tiny_lm(seed=4)
    hot = Sampling(temperature=0.8, top_p=0.9, seed=3)
    decoder = Lookahead(window="auto", ngram=3, guess_set_size="auto", auto_windows=(1, 2), auto_tokens=8,
                        auto_prompts=1, cache_dir=str(tmp_path))
    decoder.prepare(lm, PROMPTS, set(), hot)
    assert seen and all(s == hot for s in seen)
    seen.clear()
    Lookahead(window="auto", ngram=3, guess_set_size="auto", auto_windows=(1, 2), auto_tokens=8, auto_prompts=1,
              cache_dir=str(tmp_path)).prepare(lm, PROMPTS, set(), Sampling())
    assert seen and all(s.greedy for s in seen)  # not served from the sampled run's cache


def test_sequoia_measures_acceptance_at_the_runs_sampling_settings(monkeypatch):
    from decoders.methods import sequoia
    from decoders.methods.sequoia import Sequoia

    seen = []
    monkeypatch.setattr(sequoia, "cached_acceptance", lambda lm, draft, prompts, K, sampling, *a, **k:
                        seen.append(sampling) or [0.5] + [0.05] * (K - 1))
    lm = tiny_lm(seed=4)
    from decoders.methods.draft_model import SelfDraft

    decoder = Sequoia(draft=SelfDraft(layers=1), budget=4, depth=2, auto_prompts=1)
    hot = Sampling(temperature=0.7)
    decoder.prepare(lm, PROMPTS, set(), hot)
    assert seen == [hot]
