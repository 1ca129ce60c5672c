import math

import pytest
import torch

from bench import metrics
from decoders.core.trace import Generation, Step

SPEC = {"matmul_params": 1000, "n_layers": 2, "d_attn": 8}


def test_forward_flops_formula():
    # 1 token after 10 cached: 2*1000*1 + 4*2*8*(10 + 1)
    assert metrics.forward_flops(SPEC, 1, 10) == 2000 + 64 * 11
    # prefill of 3: each token attends to itself and those before it: 1 + 2 + 3 = 6 pairs
    assert metrics.forward_flops(SPEC, 3, 0) == 6000 + 64 * 6


def gen(accepted, forward, context, drafts=(), accepted_drafts=()):
    steps = [Step(committed=a, forward_tokens=f, context_tokens=c, target_time=0.1, overhead_time=0.01,
                  draft_tokens=d, accepted_draft_tokens=ad)
             for a, f, c, d, ad in zip(accepted, forward, context, drafts or [0] * len(accepted),
                                       accepted_drafts or [0] * len(accepted))]
    return Generation(tokens=list(range(sum(accepted))), steps=steps, ttft=0.1, stop_reason="length")


def test_generation_metrics():
    g = gen([1, 3, 2], [5, 4, 4], [0, 5, 8], drafts=[0, 3, 3], accepted_drafts=[0, 2, 1])
    m = metrics.generation_metrics(g, SPEC, latency=0.5)
    assert m["new_tokens"] == 6 and m["steps"] == 3 and m["tokens_per_step"] == 2.0
    assert m["tokens_per_s"] == 12.0
    assert m["forward_tokens"] == 13 and m["draft_tokens"] == 6 and m["accepted_draft_tokens"] == 3
    assert m["target_flops"] == sum(metrics.forward_flops(SPEC, f, c) for f, c in [(5, 0), (4, 5), (4, 8)])
    assert math.isclose(m["target_time_s"], 0.3) and math.isclose(m["overhead_time_s"], 0.03)


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert metrics.first_divergence([1, 2], [1, 2, 3]) == 2
    assert metrics.first_divergence([9], [1]) == 0


def record(key, tokens, steps, latency, *, ref_latency=None, lossless=None, score=None, status="ok"):
    rec = {"key": key, "decoder": "d", "model": "m", "dataset": "x", "status": status}
    if status != "ok":
        return rec
    rec.update(new_tokens=tokens, steps=steps, latency_s=latency, tokens_per_s=tokens / latency, ttft_s=0.01,
               target_time_s=latency * 0.9, draft_time_s=0.0, overhead_time_s=latency * 0.1,
               forward_tokens=steps * 3, draft_tokens=steps * 2, accepted_draft_tokens=tokens - steps,
               target_flops=100.0 * steps, draft_flops=0.0, quality_metric="pass@1" if score is not None else None,
               quality_score=score, lossless=lossless,
               reference={"latency_s": ref_latency, "new_tokens": tokens} if ref_latency else None)
    return rec


def test_summarize_aggregates_and_speedups():
    recs = [record("a", 10, 5, 1.0, ref_latency=2.0, lossless=True, score=1.0),
            record("b", 30, 10, 2.0, ref_latency=2.0, lossless=False, score=0.0),
            record("c", 0, 0, 0, status="skipped")]
    row = metrics.summarize(recs).iloc[0]
    assert row["records"] == 2 and row["skipped"] == 1
    assert row["tokens_per_step"] == 40 / 15
    assert row["tokens_per_s"] == 40 / 3.0
    assert row["tokens_per_s_median"] == 12.5
    assert row["acceptance_rate"] == 25 / 30
    assert row["flops_per_token"] == 1500 / 40
    assert row["lossless"] == 0.5 and row["quality"] == 0.5 and row["quality_metric"] == "pass@1"
    # Spec-Bench's: mean tokens/s (10/1 + 30/2) / 2 over the reference's (10/2 + 30/2) / 2;
    # geometric mean of latency ratios: sqrt(2/1 * 2/2); pooled: (40/3) / (40/4)
    assert row["speedup"] == pytest.approx(12.5 / 10)
    assert row["speedup_geomean"] == pytest.approx(math.sqrt(2.0))
    assert row["speedup_pooled"] == pytest.approx(4 / 3)
    assert row["overhead_frac"] == pytest.approx(0.1)
    # two prompts: a resample holds a, b or both, so the interval's ends are a's and b's own
    assert (row["speedup_ci_low"], row["speedup_ci_high"]) == pytest.approx((1.0, 2.0))
    assert (row["tokens_per_s_ci_low"], row["tokens_per_s_ci_high"]) == pytest.approx((10.0, 15.0))


def test_summarize_without_reference_or_checks_reports_nan():
    row = metrics.summarize([record("a", 10, 10, 1.0)]).iloc[0]
    assert row["tokens_per_step"] == 1.0
    assert math.isnan(row["lossless"]) and math.isnan(row["quality"])
    assert "speedup" not in row or math.isnan(row["speedup"])


def test_markdown_has_the_headline_columns():
    md = metrics.to_markdown(metrics.summarize([record("a", 10, 5, 1.0)]))
    for col in ["decoder", "tokens_per_step", "tokens_per_s", "flops_per_token", "lossless"]:
        assert col in md.splitlines()[0]


def test_acceptance_by_depth():
    """Per depth d: of the steps whose draft reached d, the share that accepted >= d draft tokens."""
    steps = [Step(committed=1, forward_tokens=5, context_tokens=0)]  # the prefill records no depth
    for depth, accepted in [(3, 0), (3, 2), (3, 3), (1, 1)]:
        steps.append(Step(committed=accepted + 1, forward_tokens=depth + 1, context_tokens=5,
                          info={"draft_depth": depth, "accepted_depth": accepted}))
    g = Generation(tokens=list(range(sum(s.committed for s in steps))), steps=steps, ttft=0.1, stop_reason="length")
    m = metrics.generation_metrics(g, SPEC, latency=1.0)
    assert m["depth_proposed"] == [4, 3, 3] and m["depth_accepted"] == [3, 2, 1]
    plain = metrics.generation_metrics(gen([1, 1], [3, 1], [0, 3]), SPEC, latency=1.0)
    assert plain["depth_proposed"] is None
    recs = [dict(record("a", 10, 5, 1.0), depth_proposed=m["depth_proposed"], depth_accepted=m["depth_accepted"]),
            dict(record("b", 10, 5, 1.0), depth_proposed=[2], depth_accepted=[1])]
    row = metrics.summarize(recs).iloc[0]
    assert row["acceptance_by_depth"] == "0.67 0.67 0.33"  # depth 1: (3 + 1) / (4 + 2)
    assert row["draft_time_frac"] == 0.0 and row["target_time_frac"] == pytest.approx(0.9)


def test_one_definition_per_speedup_name():
    pairs = [({"new_tokens": 10, "latency_s": 1.0}, {"new_tokens": 10, "latency_s": 2.0}),
             ({"new_tokens": 30, "latency_s": 2.0}, {"new_tokens": 30, "latency_s": 2.0})]
    assert metrics.speedups(pairs) == pytest.approx(
        {"speedup": 1.25, "speedup_geomean": math.sqrt(2.0), "speedup_pooled": 4 / 3})
    assert all(math.isnan(v) for v in metrics.speedups([]).values())


def test_mean_accepted_tokens_and_decode_flops_leave_both_prefills_out():
    """Spec-Bench's mean accepted tokens: prefill step excluded, bonus token included; decode FLOPs
    drop the target's prefill and the draft's pass over the prompt."""
    from decoders.core.trace import Generation, Step

    steps = [Step(committed=1, forward_tokens=20, context_tokens=0),
             Step(committed=3, forward_tokens=3, context_tokens=20, draft_flops=700.0, draft_prefill_flops=500.0),
             Step(committed=2, forward_tokens=3, context_tokens=23, draft_flops=200.0)]
    gen = Generation(tokens=[5] * 6, steps=steps, ttft=0.1, stop_reason="length")
    spec = {"matmul_params": 10, "n_layers": 0, "d_attn": 0}
    r = {**metrics.generation_metrics(gen, spec, 1.0), "status": "ok"}
    assert r["decode_tokens"] == 5 and r["decode_steps"] == 2
    assert metrics.mean_accepted_tokens([r]) == 2.5
    assert r["decode_draft_flops"] == 400.0
    assert metrics.decode_flops_per_step([r]) == (2 * 10 * 6 + 400.0) / 2


def test_summaries_break_down_by_category():
    recs = [{**record("a", 10, 5, 1.0), "category": "writing"}, {**record("b", 30, 10, 2.0), "category": "math"},
            {**record("c", 20, 10, 1.0), "category": "math"}]
    whole = metrics.summarize(recs)
    assert len(whole) == 1 and whole.iloc[0]["records"] == 3
    by = metrics.summarize(recs, by_category=True).set_index("category")
    assert by.loc["math", "records"] == 2 and by.loc["math", "tokens_per_step"] == 50 / 20
    assert by.loc["writing", "records"] == 1


def test_streamed_columns_summarize_as_the_records_do():
    # bench.report streams records into the columns summarize reads: every summary figure,
    # the lossless verdicts included, must come out as from the records themselves.
    from bench.report import columns
    recs = [record("a", 10, 5, 1.0, ref_latency=2.0, lossless=True, score=1.0),
            record("b", 30, 10, 2.0, ref_latency=2.0, lossless=False, score=0.0),
            record("c", 20, 10, 2.0, ref_latency=2.0, lossless=False, score=0.0)]
    recs[1]["divergence_tie"] = True
    recs[2]["divergence_tie"] = False
    direct, streamed = metrics.summarize(recs).iloc[0], metrics.summarize(columns(recs)).iloc[0]
    assert direct["lossless"] == pytest.approx(1 / 3) and direct["lossless_up_to_ties"] == pytest.approx(2 / 3)
    assert direct["real_divergences"] == 1
    for name in ("lossless", "lossless_up_to_ties", "real_divergences", "tokens_per_step", "speedup",
                 "mean_accepted_tokens", "quality"):
        assert streamed[name] == pytest.approx(direct[name], nan_ok=True), name


def test_accepted_by_output_position_bins_decoding_steps_by_where_they_start():
    """The prefill step is left out (as in mean_accepted_tokens); a step counts in the bin of the
    position it starts at; skipped records add nothing."""
    a = {"status": "ok", "trace": {"committed": [1, 3, 4, 1, 2], "position": [0, 1, 4, 8, 9]}}
    b = {"status": "ok", "trace": {"committed": [1, 1, 5, 2], "position": [0, 1, 2, 7]}}
    table = metrics.accepted_by_output_position([a, b, {"status": "skipped"}], bin_tokens=4)
    assert table.to_dict("records") == [
        {"position": 0, "steps": 3, "outputs": 2, "mean_accepted_tokens": 3.0},   # a: 3; b: 1, 5
        {"position": 4, "steps": 2, "outputs": 2, "mean_accepted_tokens": 3.0},   # a: 4; b: 2
        {"position": 8, "steps": 2, "outputs": 1, "mean_accepted_tokens": 1.5}]   # a: 1, 2
    # the same steps, pooled: the bins' weighted mean is mean_accepted_tokens over both records
    pooled = (table["mean_accepted_tokens"] * table["steps"]).sum() / table["steps"].sum()
    assert pooled == (3 + 4 + 1 + 2 + 1 + 5 + 2) / 7
    with pytest.raises(ValueError, match="bin_tokens"):
        metrics.accepted_by_output_position([a], bin_tokens=0)


def test_decode_step_time_split_and_in_reference_steps():
    """Per decoding step (the prefill left out): target, draft and the rest in ms, summing to the
    step; in the reference's steps, the whole step is the ratio that divides mean accepted tokens."""
    mine = [{"trace": {"target_time": [0.5, 0.012, 0.012], "draft_time": [0.0, 0.004, 0.004],
                       "overhead_time": [0.1, 0.002, 0.002]}},
            {"trace": {"target_time": [0.3, 0.012], "draft_time": [0.0, 0.004], "overhead_time": [0.0, 0.002]}},
            {"status": "skipped"}]
    split = metrics.decode_step_ms(mine)
    assert split == pytest.approx({"step_ms": 18.0, "target_ms": 12.0, "draft_ms": 4.0, "other_ms": 2.0})
    reference = metrics.decode_step_ms([{"trace": {"target_time": [0.4, 0.01, 0.01], "draft_time": [0.0] * 3,
                                                   "overhead_time": [0.0, 0.002, 0.002]}}])
    assert reference == pytest.approx({"step_ms": 12.0, "target_ms": 10.0, "draft_ms": 0.0, "other_ms": 2.0})
    assert metrics.in_reference_steps(split, reference) == pytest.approx(
        {"step_in_ar_steps": 1.5, "target_in_ar_steps": 1.0, "draft_in_ar_steps": 1 / 3, "other_in_ar_steps": 1 / 6})
    assert math.isnan(metrics.decode_step_ms([])["step_ms"])


def _run(tokens, seconds):
    return {"new_tokens": tokens, "latency_s": seconds}


def test_speedup_interval_keeps_each_run_paired_with_its_reference():
    """Every run exactly twice as fast as its reference, whose times vary 5x: the interval is [2, 2].
    The negative control draws the references unpaired and gets a wide interval."""
    import numpy as np

    ref_seconds = np.random.default_rng(0).uniform(1.0, 5.0, 24)
    pairs = [(_run(10, s / 2), _run(10, s)) for s in ref_seconds]
    prompts = [i // 3 for i in range(24)]  # 8 prompts x 3 repeats
    ci = metrics.speedup_interval(pairs, prompts)
    assert ci["speedup_ci_low"] == pytest.approx(2.0) and ci["speedup_ci_high"] == pytest.approx(2.0)
    mine = [a for a, _ in pairs]
    rate = metrics.tokens_per_s_interval(mine, prompts)
    assert rate["tokens_per_s_ci_low"] < metrics.pooled_tokens_per_s(mine) < rate["tokens_per_s_ci_high"]
    shuffled = [(a, b) for (a, _), (_, b) in zip(pairs, [pairs[(i + 7) % 24] for i in range(24)])]
    unpaired = metrics.speedup_interval(shuffled, prompts)
    assert unpaired["speedup_ci_high"] - unpaired["speedup_ci_low"] > 0.3
    # Prompts with their own numbers of runs (1 to 4: a run failed, or was resumed): the padded slots
    # of the shorter ones count in neither sum, so the interval is still [2, 2].
    prompts = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 5, 5]
    uneven = metrics.speedup_interval(pairs[:len(prompts)], prompts)
    assert (uneven["speedup_ci_low"], uneven["speedup_ci_high"]) == pytest.approx((2.0, 2.0))
    # 20 tokens/s in every run, of two sizes: tokens and seconds must be summed over the same slots
    flat = metrics.tokens_per_s_interval([_run(10, 0.5)] + [_run(30, 1.5)] * (len(prompts) - 1), prompts)
    assert (flat["tokens_per_s_ci_low"], flat["tokens_per_s_ci_high"]) == pytest.approx((20.0, 20.0))


def test_speedup_interval_covers_the_true_speedup_and_not_no_speedup():
    """Runs drawn around a true speedup of 1.5 (noise on both sides): the interval holds 1.5 and
    not 1.0; with five times fewer prompts it is wider."""
    import numpy as np

    rng = np.random.default_rng(1)

    def pairs(n):
        return [(_run(100, 1.0 / (1.5 * rng.lognormal(0, 0.1))), _run(100, 1.0 / rng.lognormal(0, 0.1)))
                for _ in range(n)]
    many, few = metrics.speedup_interval(pairs(100)), metrics.speedup_interval(pairs(20))
    assert many["speedup_ci_low"] < 1.5 < many["speedup_ci_high"] and many["speedup_ci_low"] > 1.0
    assert few["speedup_ci_high"] - few["speedup_ci_low"] > many["speedup_ci_high"] - many["speedup_ci_low"]
    assert math.isnan(metrics.speedup_interval([])["speedup_ci_low"])
    assert math.isnan(metrics.tokens_per_s_interval([])["tokens_per_s_ci_high"])


def test_repeats_widen_the_interval_only_by_their_own_noise():
    """One prompt's repeats are resampled within it: identical repeats add nothing, so the interval
    over 10 prompts x 3 identical repeats equals the one over the 10 prompts alone."""
    import numpy as np

    seconds = np.random.default_rng(2).uniform(1.0, 2.0, 10)
    alone = [(_run(10, s), _run(10, 1.5)) for s in seconds]
    tripled = [p for p in alone for _ in range(3)]
    a = metrics.speedup_interval(alone)
    b = metrics.speedup_interval(tripled, [i // 3 for i in range(30)])
    assert (b["speedup_ci_low"], b["speedup_ci_high"]) == pytest.approx((a["speedup_ci_low"], a["speedup_ci_high"]),
                                                                        rel=0.05)
    as_if_thirty = metrics.speedup_interval(tripled)  # each repeat taken for its own prompt: too narrow
    assert as_if_thirty["speedup_ci_high"] - as_if_thirty["speedup_ci_low"] < \
        0.8 * (b["speedup_ci_high"] - b["speedup_ci_low"])


def test_overlapping_intervals():
    nan = float("nan")
    assert metrics.overlapping({"a": (1.0, 2.0), "b": (1.5, 3.0), "c": (3.5, 4.0), "d": (nan, nan)}) == \
        {"a": ["b"], "b": ["a"], "c": [], "d": []}
    # intervals that share only an end overlap: the table cannot order them either
    assert metrics.overlapping({"a": (1.0, 2.0), "b": (2.0, 3.0), "c": (3.0000001, 4.0)}) == \
        {"a": ["b"], "b": ["a"], "c": []}


# ---- acceptance in every engine's definition (docs/acceptance.md) ----------------------------------
# A hand-made trace where the definitions differ: per step (committed, drafts proposed, drafts accepted),
# the prefill first. Question q1 has two turns, q2 one. q1's first turn has a step without drafts and a
# last step cut at a stop token (3 drafts verified, 2 kept, no bonus); q2's method drafts at the prefill.
ENGINE_TRACE = {
    ("q1", 0): [(1, 0, 0), (3, 4, 2), (1, 0, 0), (5, 4, 4), (2, 4, 2)],
    ("q1", 1): [(1, 0, 0), (2, 3, 1), (4, 3, 3)],
    ("q2", 0): [(3, 3, 2), (4, 3, 3), (1, 3, 0), (3, 3, 2)],
}


def engine_records() -> list[dict]:
    recs = []
    for (prompt, turn), rows in ENGINE_TRACE.items():
        steps = [Step(committed=c, forward_tokens=d + 1, context_tokens=10, draft_tokens=d, accepted_draft_tokens=a,
                      target_time=0.1) for c, d, a in rows]
        g = Generation(tokens=list(range(sum(c for c, _, _ in rows))), steps=steps, ttft=0.1, stop_reason="length")
        recs.append({**metrics.generation_metrics(g, SPEC, 1.0), "key": f"{prompt}#{turn}", "prompt_id": prompt,
                     "turn": turn, "decoder": "d", "model": "m", "dataset": "x", "status": "ok", "reference": None,
                     "trace": g.trace_columns()})
    return recs


def test_each_engines_acceptance_from_a_hand_made_trace():
    recs = engine_records()
    # ours: 30 new tokens in 12 forwards; Spec-Bench's: 25 tokens in the 9 decoding steps (prefills out)
    assert metrics.tokens_per_step(recs) == 30 / 12
    assert metrics.mean_accepted_tokens(recs) == pytest.approx(25 / 9)
    # vLLM: the 9 steps that verified drafts (q1's draftless step out, q2's prefill in) accepted 8 + 4 + 7
    assert metrics.vllm_mean_acceptance_length(recs) == pytest.approx(1 + 19 / 9)
    assert metrics.vllm_acceptance_by_position(recs) == pytest.approx([8 / 9, 7 / 9, 3 / 9, 1 / 9])
    # SGLang: accepted + 1 over every decoding step, the cut step's bonus and the draftless step's 1 included
    assert metrics.sglang_accept_length(recs) == pytest.approx((12 + 6 + 8) / 9)
    # EAGLE: per turn, its steps' accepted + 1 over its last step's index: q1 (12/3 + 6/1) / 2 = 5, q2 8/2 = 4
    assert metrics.eagle_tau(recs) == 4.5
    figures = [metrics.tokens_per_step(recs), metrics.mean_accepted_tokens(recs),
               metrics.vllm_mean_acceptance_length(recs), metrics.sglang_accept_length(recs), metrics.eagle_tau(recs)]
    assert len({round(f, 6) for f in figures}) == len(figures)  # the trace tells every definition apart


def test_engine_acceptance_reads_older_records_from_their_trace_and_leaves_out_what_it_cannot_count():
    recs = engine_records()
    older = [{k: v for k, v in r.items() if k not in ("draft_steps", "accepted_at_least", "verified_tokens")}
             for r in recs]
    assert metrics.engine_acceptance(older) == metrics.engine_acceptance(recs)
    one_step = {**recs[1], "decode_steps": 1}  # EAGLE's loop index would be 0: left out, not a division by zero
    assert math.isnan(metrics.eagle_tau([one_step]))
    untraced = [{k: v for k, v in r.items() if k != "trace"} for r in older]
    assert math.isnan(metrics.vllm_mean_acceptance_length(untraced)) and metrics.vllm_acceptance_by_position([]) == []
    assert all(math.isnan(metrics.engine_acceptance([])[k]) for k in ("sglang_accept_length", "eagle_tau"))


def test_summaries_and_streamed_columns_carry_every_engines_acceptance():
    from bench.report import columns

    recs = engine_records()
    direct, streamed = metrics.summarize(recs).iloc[0], metrics.summarize(columns(recs)).iloc[0]
    assert direct["vllm_acceptance_by_position"] == "0.89 0.78 0.33 0.11" and direct["eagle_tau"] == 4.5
    for name in ("vllm_mean_acceptance_length", "vllm_acceptance_by_position", "sglang_accept_length", "eagle_tau"):
        assert streamed[name] == pytest.approx(direct[name]) if name != "vllm_acceptance_by_position" else \
            streamed[name] == direct[name], name
        assert name in metrics.to_markdown(metrics.summarize(recs)).splitlines()[0]
def test_a_referee_at_the_runs_precision_proves_a_tie_by_disagreeing_as_much():
    """llama.cpp's referee is a second computation in float32, like the step: a departure is a tie where the two
    differ (anywhere in the vocabulary) by at least the chosen token's margin below the step's top-1, else real."""
    step = torch.tensor([2.0, 1.9, 0.0])  # token 1: 0.1 below the top-1, hundreds of thousands of ulps
    for second, tie in ((torch.tensor([1.9, 2.0, 0.0]), True), (torch.tensor([2.0, 1.9, 0.05]), False)):
        verdict = metrics.judge_output([0, 1], [0, 0], [step, step], referee=lambda i, s=second: s)
        assert verdict["divergence_tie"] is tie and verdict["ties_by_second_computation"] == int(tie)
        assert verdict["ties_in_wider_dtype"] == 0
    # several second computations (llama.cpp's prefix batched two ways): the farthest from the step decides
    for seconds, tie in ((torch.tensor([[2.0, 1.9, 0.0], [1.9, 2.0, 0.0]]), True),
                         (torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.05]]), False)):
        verdict = metrics.judge_output([0, 1], [0, 0], [step, step], referee=lambda i, s=seconds: s)
        assert verdict["divergence_tie"] is tie and verdict["ties_by_second_computation"] == int(tie)
    wider = metrics.judge_output([0, 1], [0, 0], [step, step], referee=lambda i: torch.tensor([1.9, 2.0, 0.0]).double())
    assert wider["divergence_tie"] is True and wider["ties_in_wider_dtype"] == 1  # a wider one ranks by ulps
