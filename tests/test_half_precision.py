"""Half precision: the lossless check tells ties from bugs, every decoder equals autoregressive
greedy up to ties, and sampling stays exact, in bfloat16 and float16.

The suite runs in float32; this slice runs the same checks on tiny-random in bf16 and fp16, on
the CPU and, under the `cuda` marker, on CUDA (skipped with a reason where there is none).
In half precision a k-token forward and a 1-token step round differently, so greedy equality is
checked up to ties (bench/metrics.py, judge_output: every token within TIE_ULPS of the target's
top-1 on the output's own path).
"""
from __future__ import annotations

import pytest
import torch

import test_exact_verification as exact
import test_sampling
from bench import metrics
from bench.runner import judge_lossless
from decoders.core.sampling import Sampling, probs
from decoders.methods.autoregressive import autoregressive_decode
from helpers import chi2_pvalue, tiny_lm
from test_greedy_equality import DECODERS, GREEDY, check_trace, tiny_case

DTYPES = ["bfloat16", "float16"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# One configuration per method, the first test_greedy_equality lists for it: every decoder, at
# a fraction of the float32 suite's cost.
ONE_PER_METHOD = {}
for _label, _decoder in DECODERS.items():
    ONE_PER_METHOD.setdefault(_decoder.name, _label)


# ---- the rule --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ulp_is_the_spacing_of_the_dtype(dtype):
    for x in (0.3, 1.0, 1.5, -7.25, 100.0):
        v = torch.tensor(x, dtype=dtype)
        assert (float(torch.nextafter(v.abs(), torch.tensor(float("inf"), dtype=dtype)) - v.abs())
                == metrics.ulp(x, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_departure_in_ulps(dtype):
    """A token 1 ulp below the top is a tie, a third token far below is not, even when the top
    two are tied: the chosen token must be one of the near-tied ones."""
    top = torch.tensor(5.0, dtype=dtype)
    below = torch.nextafter(top, torch.tensor(0.0, dtype=dtype))
    logits = torch.stack([top, below, top - 3, top]).to(dtype)
    assert metrics.departure_ulps(logits, 0) == 0 and metrics.departure_ulps(logits, 3) == 0
    assert metrics.departure_ulps(logits, 1) == 1
    assert metrics.departure_ulps(logits, 2) > 10 * metrics.TIE_ULPS


# ---- a genuine tie against a genuine bug, through the runner's check ---------------------------
def _greedy(lm, prompt, n, choose, change=lambda i, t, row: t):
    """Greedy decoding with a chosen tie-breaking rule; `change` may replace the token at step i."""
    cache, tokens, feed = lm.new_cache(), [], list(prompt)
    for i in range(n):
        row = lm.forward(feed, cache, last_only=True)[-1]
        tokens.append(change(i, choose(row), row))
        feed = [tokens[-1]]
    return tokens


def _first(row):
    return int(row.argmax())


def _last(row):  # a tie broken the other way: the last of the tied tokens
    return len(row) - 1 - int(row.flip(0).argmax())


@pytest.fixture(scope="module", params=[pytest.param((d, "cpu"), id=f"{d}-cpu") for d in DTYPES]
                + [pytest.param((d, "cuda"), id=f"{d}-cuda", marks=pytest.mark.cuda) for d in DTYPES])
def tied(request):
    """tiny-random with one lm_head row copied onto another: two tokens' logits are exactly equal
    at every step, and the pair is the top at step 2 or before. Returns the lm, a prompt and the
    reference output (ties to the first index, as torch.argmax)."""
    dtype, device = request.param
    lm = tiny_lm(seed=1, dtype=dtype, device=device)
    prompt = [3, 14, 15, 9, 2]
    a = autoregressive_decode(lm, prompt, 3, GREEDY, set()).tokens[2]
    b = (a + 17) % 64
    with torch.no_grad():
        head = lm.model.get_output_embeddings().weight
        head[b] = head[a]
    reference = autoregressive_decode(lm, prompt, 16, GREEDY, set()).tokens
    assert reference == _greedy(lm, prompt, 16, _first)
    return lm, prompt, reference


def test_a_genuine_tie_is_a_tie(tied):
    lm, prompt, reference = tied
    tokens = _greedy(lm, prompt, 16, _last)
    verdict = judge_lossless(lm, prompt, tokens, reference)
    assert verdict["lossless"] is False and verdict["first_divergence"] <= 2
    assert verdict["divergence_ulps"] == 0 and verdict["divergence_logit_gap"] == 0
    assert verdict["divergence_tie"] is True and verdict["first_real_divergence"] is None
    assert verdict["ties_in_wider_dtype"] == 0  # an exact tie needs no referee


def test_a_genuine_bug_is_a_real_divergence(tied):
    """A wrong token where the gap is large (the step's lowest logit), before and after a tie:
    the tie rule never hides it."""
    lm, prompt, reference = tied
    worst = lambda at: lambda i, t, row: int(row.argmin()) if i == at else t  # noqa: E731
    bug = _greedy(lm, prompt, 16, _first, worst(6))
    verdict = judge_lossless(lm, prompt, bug, reference)
    assert verdict["first_divergence"] == 6 and verdict["first_real_divergence"] == 6
    assert verdict["divergence_ulps"] > 100 * metrics.TIE_ULPS and verdict["divergence_tie"] is False
    assert verdict["ties_in_wider_dtype"] == 0  # the referee, consulted, ranks it low too

    tie_then_bug = _greedy(lm, prompt, 16, _last, worst(10))
    late = judge_lossless(lm, prompt, tie_then_bug, reference)
    assert late["first_divergence"] <= 2 and late["divergence_ulps"] == 0  # departs at the tie...
    assert late["first_real_divergence"] == 10 and late["divergence_tie"] is False  # ...and the bug is caught

    tie = judge_lossless(lm, prompt, _greedy(lm, prompt, 16, _last), reference)
    same = judge_lossless(lm, prompt, reference, reference)
    assert metrics.lossless_columns([same, tie, verdict, late]) == {
        "lossless": 0.25, "lossless_up_to_ties": 0.5, "real_divergences": 2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_departure_past_the_step_tolerance_is_a_tie_only_where_the_wider_dtype_ranks_it_first(dtype):
    """A half-precision computation can be more than TIE_ULPS off the exact logits (tiny-random in
    bf16 on an H200: 15 ulps, and batch 4 chose a token the step put 5 ulps low that float64 put
    above the step's top-1). The referee (the same weights in float32) proves a tie the step alone
    cannot, with ulps counted in the run's dtype; where it ranks the token low too, or is missing,
    the departure stays real."""
    dtype = getattr(torch, dtype)
    unit = metrics.ulp(1.5, dtype)
    step = torch.tensor([1.5, 1.5 - 6 * unit, 1.0], dtype=dtype)  # token 1: 6 ulps below, past TIE_ULPS
    close = torch.tensor([1.5, 1.5 - 3 * unit, 1.0], dtype=torch.float32)  # the referee: 3 run-dtype ulps
    calls = []

    def referee(logits):
        return lambda i: calls.append(i) or logits

    tie = metrics.judge_output([0, 1], [0, 0], [step, step], referee=referee(close))
    assert tie["first_divergence"] == 1 and tie["divergence_ulps"] == 6
    assert tie["divergence_tie"] is True and tie["ties_in_wider_dtype"] == 1 and calls == [1]
    # 6 ulps of the run's dtype are thousands of float32's: the unit is the run's, not the referee's
    far = torch.tensor([1.5, 1.5 - 6 * unit, 1.0], dtype=torch.float32)
    real = metrics.judge_output([0, 1], [0, 0], [step, step], referee=referee(far))
    assert real["first_real_divergence"] == 1 and real["divergence_tie"] is False and real["ties_in_wider_dtype"] == 0
    for missing in (None, lambda i: None):  # no referee, or one that did not fit: the step decides
        assert metrics.judge_output([0, 1], [0, 0], [step, step], referee=missing)["first_real_divergence"] == 1
    calls.clear()
    near = step.clone()
    near[1] = 1.5 - unit  # within TIE_ULPS: no referee at all
    assert metrics.judge_output([0, 1], [0, 0], [near, near], referee=referee(far))["divergence_tie"] is True
    assert calls == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tie_bound_is_inclusive_and_a_difference_in_length_is_never_a_tie(dtype):
    """A token TIE_ULPS below the step's top-1 is a tie, one ulp more is not (no referee); an output
    that stops early or runs on departs in length, which no logit can excuse, even where the token
    it has over the reference is the step's own top-1."""
    dtype = getattr(torch, dtype)
    unit = metrics.ulp(1.5, dtype)
    for below, tie in ((metrics.TIE_ULPS, True), (metrics.TIE_ULPS + 1, False)):
        step = torch.tensor([1.5, 1.5 - below * unit, 1.0], dtype=dtype)
        verdict = metrics.judge_output([0, 1], [0, 0], [step, step])
        assert verdict["divergence_ulps"] == below and verdict["divergence_tie"] is tie
    top1 = torch.tensor([1.0, 1.5, 1.0], dtype=dtype)  # token 1 is the step's top-1
    for tokens, reference in (([1], [1, 1]), ([1, 1, 1], [1, 1])):
        verdict = metrics.judge_output(tokens, reference, [top1] * len(tokens))
        assert verdict["first_real_divergence"] == min(len(tokens), len(reference))
        assert verdict["divergence_tie"] is False and verdict["lossless"] is False


@pytest.mark.parametrize("dtype,wide", [("bfloat16", torch.float32), ("float32", torch.float64)])
@pytest.mark.parametrize("fast_path", ["none", "prepacked"])
def test_the_referee_is_the_same_weights_in_a_wider_dtype_and_leaves_the_model_alone(dtype, wide, fast_path):
    """referee_logits(i) = transformers' forward of the model's own weights cast to the wider dtype
    (float32 for half precision, float64 for float32), off the fast path; closer to float64 than
    the run's step; the LM keeps its dtype, path and logits."""
    from decoders.core.fast_path import prepacked_supported
    from decoders.methods.autoregressive import referee_logits, step_logits

    lm = tiny_lm(seed=3, dtype=dtype, fast_path=fast_path)
    if fast_path != "none" and lm.fast_path != fast_path:
        pytest.skip(f"{fast_path} unavailable: {prepacked_supported(lm.model)}")
    plain = tiny_lm(seed=3, dtype=dtype, fast_path="none").model.to(wide)
    exact = tiny_lm(seed=3, dtype=dtype, fast_path="none").model.to(torch.float64)
    prompt, tokens = [3, 14, 15, 9, 2], [7, 21, 40, 5]
    with torch.inference_mode():
        before = list(step_logits(lm, prompt, tokens))
        referee = referee_logits(lm, prompt, tokens)
        for i in (0, 3):
            got = referee(i)
            ids = torch.tensor([[*prompt, *tokens[:i]]])
            same = plain(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]  # as referee_logits asks
            assert got.dtype == wide and torch.equal(got, same)
            truth = exact(input_ids=ids).logits[0, -1]
            assert (got.double() - truth).abs().max() < (before[i].double() - truth).abs().max()
        after = list(step_logits(lm, prompt, tokens))
    assert lm.dtype == getattr(torch, dtype) and lm.fast_path == fast_path
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_summary_reports_ties_and_real_divergences():
    base = {"decoder": "d", "model": "m", "dataset": "x", "status": "ok", "new_tokens": 4, "steps": 4,
            "latency_s": 1.0, "tokens_per_s": 4.0, "ttft_s": 0.1, "target_time_s": 1, "draft_time_s": 0,
            "overhead_time_s": 0, "forward_tokens": 4, "target_flops": 1, "draft_flops": 0, "draft_tokens": 0,
            "accepted_draft_tokens": 0, "quality_metric": None, "quality_score": None, "reference": None}
    records = [dict(base, lossless=True, divergence_tie=None), dict(base, lossless=False, divergence_tie=True),
               dict(base, lossless=False, divergence_tie=False), dict(base, lossless=False)]  # no verdict: real
    row = metrics.summarize(records).iloc[0]
    assert (row["lossless"], row["lossless_up_to_ties"], row["real_divergences"]) == (0.25, 0.5, 2)
    assert "lossless_up_to_ties" in metrics.to_markdown(metrics.summarize(records))


# ---- every decoder: greedy equality up to ties -------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decoder", ONE_PER_METHOD.values())
def test_greedy_equality_up_to_ties(decoder, dtype, device):
    lm = tiny_lm(seed=2, dtype=dtype, device=device)
    prompt = tiny_case(2, "repetitive")  # prompt lookup and the n-gram pools find matches
    reference = autoregressive_decode(lm, prompt, 20, GREEDY, stop_ids=set())
    out = DECODERS[decoder].generate(lm, prompt, 20, GREEDY, set())
    check_trace(out, 20, set())
    verdict = judge_lossless(lm, prompt, out.tokens, reference.tokens)
    assert verdict["first_real_divergence"] is None, verdict


# ---- sampling stays exact ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_probs_of_half_logits_are_float32(dtype):
    logits = (torch.randn(3, 20, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    s = Sampling(temperature=0.8, top_p=0.9, top_k=12)
    out = probs(logits, s)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, test_sampling._reference_probs(logits.float(), 0.8, 12, 0.9))


class HalfTables(exact.Tables):
    """The exact-enumeration tables as a half-precision model gives them: each distribution
    becomes logits rounded to the dtype, then probabilities through the production probs()."""

    def __init__(self, seed: int, V: int, dtype: torch.dtype):
        super().__init__(seed, V)
        for table in (self.p, self.q):
            for prefix, row in table.items():
                logits = row.clamp_min(1e-30).log().to(dtype)
                logits[row == 0] = torch.finfo(dtype).min  # a token top-p / top-k cut stays cut
                rounded = probs(logits[None], Sampling(temperature=1.0))[0].double()
                table[prefix] = rounded / rounded.sum()  # exactly normalised, as the reference joint assumes


HALF_CASES = {name: exact.CORRECT[name] for name in
              ("chain-3", "specinfer-k2-d2", "sequoia-2-2-1", "deterministic-dup_siblings")}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", HALF_CASES)
def test_exact_distribution_from_half_logits(case, dtype):
    run, n, V, seeds = HALF_CASES[case]
    worst = 0.0
    for seed in list(seeds)[:4]:
        t = HalfTables(seed, V, dtype)
        worst = max(worst, exact.l1(exact.exact_distribution(lambda oracle: run(oracle, t)), t.joint(n)))
    assert worst < exact.EXACT


N_HALF = 2000


# long on the CPU (slow); on CUDA, part of the GPU check's `-m "cuda and not slow"`
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), *DEVICES[1:]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_autoregressive_samples_exact_two_token_distribution_in_half(dtype, device, one_thread):
    """test_sampling's end-to-end check in half precision: the first two sampled tokens follow
    the distribution the half-precision model's own logits define (chi-square, p > 1e-3)."""
    lm = tiny_lm(seed=0, vocab=test_sampling.VOCAB, init_std=0.2, dtype=dtype, device=device)
    s, prompt, vocab = Sampling(**test_sampling.SAMPLING), test_sampling.PROMPT, test_sampling.VOCAB
    p1 = probs(lm.forward(prompt, lm.new_cache())[-1:], s)[0].double().cpu()
    joint = torch.stack([p1[x] * probs(lm.forward(prompt + [x], lm.new_cache())[-1:], s)[0].double().cpu()
                         for x in range(vocab)])
    joint /= joint.sum()
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for seed in range(N_HALF):
        a, b = autoregressive_decode(lm, prompt, 2, Sampling(**test_sampling.SAMPLING, seed=seed), set()).tokens
        counts[a, b] += 1
    assert counts[joint == 0].sum() == 0, "a token outside the top-p nucleus was sampled"
    assert chi2_pvalue(counts, joint) > test_sampling.ALPHA


one_thread = test_sampling.one_thread  # the same fixture: the tiny model's ops are faster on one thread
