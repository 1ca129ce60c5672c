"""Sampling: validation, probs() against transformers' own warpers, greedy ties, and an
end-to-end check that our autoregressive sampler and transformers' generate() both sample the
EXACT distribution of the first two tokens (chi-square goodness of fit, p-value threshold 1e-3,
fixed seeds)."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decoders.core.hf_trace import hf_generate
from decoders.methods.autoregressive import autoregressive_decode
from decoders.core.sampling import Sampling, argmax, next_token, probs
from helpers import chi2_pvalue, tiny_lm

ALPHA = 1e-3


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "gen.temperature"),
    (dict(temperature=-1e-9), "gen.temperature"),
    (dict(temperature=float("nan")), "gen.temperature"),
    (dict(temperature=0.7, top_p=0.0), "gen.top_p"),
    (dict(temperature=0.7, top_p=-0.5), "gen.top_p"),
    (dict(temperature=0.7, top_p=1.0001), "gen.top_p"),
    (dict(temperature=0.7, top_p=float("nan")), "gen.top_p"),
    (dict(temperature=0.7, top_k=-1), "gen.top_k"),
    (dict(temperature=0.7, top_k=2.5), "gen.top_k"),
    (dict(temperature=0.7, top_k=3.0), "gen.top_k"),
    (dict(temperature=0.7, top_k="3"), "gen.top_k"),
])
def test_sampling_validation(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Sampling(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(), dict(temperature=0.0), dict(temperature=1.0, top_p=1.0),
                                    dict(temperature=0.5, top_p=1e-6, top_k=0), dict(temperature=2.0, top_k=1)])
def test_sampling_valid_settings(kwargs):
    s = Sampling(**kwargs)
    assert s.greedy == (s.temperature == 0)
    assert (s.generator("cpu") is None) == s.greedy


# ---- probs() == transformers' warpers ----------------------------------------------------------
def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' chain in generate()'s order: temperature, top-k, top-p, then softmax."""
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    scores = logits.float().clone()
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 0, 1.0), (0.7, 0, 0.9), (1.0, 5, 1.0),
    (0.6, 10, 0.8), (1.3, 3, 0.95), (0.9, 1, 1.0), (1.0, 0, 0.3), (0.8, 50, 0.5),
])
def test_probs_matches_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(int(temperature * 100) + top_k * 7 + int(top_p * 1000))
    logits = torch.randn(16, 40, generator=g) * 3
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = probs(logits, s)
    ref = _reference_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == torch.float32 and ours.shape == logits.shape
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert torch.allclose(ours.sum(-1), torch.ones(16))
    # the truncations really happen (these would fail if a warper were silently dropped)
    support = (ours > 0).sum(-1)
    if top_k > 0:
        assert torch.all(support <= top_k)
    if top_p < 1.0:
        assert torch.all(support < 40)
        # top-p keeps the smallest set of top tokens whose mass reaches top_p
        temp = torch.softmax(logits / temperature, -1) if top_k == 0 else None
        if temp is not None:
            for row in range(16):
                sorted_p = temp[row].sort(descending=True).values
                n_needed = int((sorted_p.cumsum(0) < top_p).sum()) + 1
                assert support[row] == n_needed


def test_probs_bfloat16_logits_become_float32():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0)).bfloat16()
    s = Sampling(temperature=0.8, top_p=0.9)
    out = probs(logits, s)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _reference_probs(logits.float(), 0.8, 0, 0.9))


def test_greedy_next_token_is_argmax_first_index_on_ties():
    s = Sampling()
    assert next_token(torch.tensor([0.0, 2.0, 2.0, 1.0]), s, None) == 1
    assert next_token(torch.tensor([5.0, 5.0, 5.0]), s, None) == 0
    assert next_token(torch.tensor([-1.0, -3.0, 4.0, 4.0]), s, None) == 2
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        row = torch.randint(0, 4, (30,), generator=g).float()  # many ties
        first_max = int((row == row.max()).nonzero()[0])
        assert next_token(row, s, None) == first_max
    # greedy ignores top_p / top_k settings entirely
    assert next_token(torch.tensor([0.0, 2.0, 2.0, 1.0]), Sampling(temperature=0, top_p=0.1, top_k=1), None) == 1


@pytest.mark.slow
def test_sampled_next_token_distribution():
    logits = torch.tensor([2.0, 1.5, 0.3, -0.5, 1.0, -3.0, 0.0])
    s = Sampling(temperature=0.8, top_k=5, top_p=0.95)
    p = probs(logits[None], s)[0].double()
    assert (p == 0).sum() >= 2  # top-k / top-p cut something
    g = torch.Generator().manual_seed(5)
    warpers = s.warpers()
    N = 20_000
    counts = torch.bincount(torch.tensor([next_token(logits, s, g, warpers) for _ in range(N)]), minlength=7)
    assert counts[p == 0].sum() == 0
    assert chi2_pvalue(counts, p) > ALPHA
    # negative control: the same counts against the un-truncated softmax are rejected
    assert chi2_pvalue(counts, torch.softmax(logits.double() / 0.8, -1)) < ALPHA


# ---- end to end: our sampler and transformers' generate() against the exact distribution ----------
SAMPLING = dict(temperature=0.7, top_p=0.9)
PROMPT = [0, 5]
VOCAB = 8
N_E2E = 3000


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's ops are too small to gain from intra-op threads; one thread is faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm_and_joint(one_thread):
    # init_std 0.2: next-token distributions far from uniform yet spread over several tokens
    # after temperature 0.7 and top-p 0.9 (which cuts some tokens: zero cells in the joint)
    lm = tiny_lm(seed=0, vocab=VOCAB, init_std=0.2)
    s = Sampling(**SAMPLING)
    logits1 = lm.forward(PROMPT, lm.new_cache())[-1:]
    p1 = probs(logits1, s)[0].double()
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for x1 in range(VOCAB):
        if p1[x1] > 0:
            logits2 = lm.forward(PROMPT + [x1], lm.new_cache())[-1:]
            joint[x1] = p1[x1] * probs(logits2, s)[0].double()
    joint /= joint.sum()
    # the test needs a distribution that is neither degenerate nor trivial
    assert int((p1 > 0).sum()) >= 3 and float(p1.max()) < 0.6
    assert int((joint * N_E2E >= 5).sum()) >= 12
    assert int((joint == 0).sum()) > 0
    return lm, joint


def _pair_counts(generate) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for seed in range(N_E2E):
        tokens = generate(Sampling(**SAMPLING, seed=seed))
        assert len(tokens) == 2, tokens
        counts[tokens[0], tokens[1]] += 1
    return counts


@pytest.mark.slow
def test_autoregressive_samples_exact_two_token_distribution(lm_and_joint):
    lm, joint = lm_and_joint
    counts = _pair_counts(lambda s: autoregressive_decode(lm, PROMPT, 2, s, stop_ids=set()).tokens)
    assert counts[joint == 0].sum() == 0, "a token outside the top-p nucleus was sampled"
    p = chi2_pvalue(counts, joint)
    assert p > ALPHA, (counts / N_E2E, joint, p)
    # negative control: the same counts against the distribution without top-p are rejected
    lm_s = Sampling(temperature=0.7)
    p1 = probs(lm.forward(PROMPT, lm.new_cache())[-1:], lm_s)[0].double()
    wrong = torch.stack([p1[x] * probs(lm.forward(PROMPT + [x], lm.new_cache())[-1:], lm_s)[0].double()
                         for x in range(VOCAB)])
    assert chi2_pvalue(counts, wrong / wrong.sum()) < ALPHA


@pytest.mark.slow
def test_hf_generate_samples_exact_two_token_distribution(lm_and_joint):
    lm, joint = lm_and_joint
    with torch.random.fork_rng(devices=[]):  # hf_generate seeds the global RNG
        counts = _pair_counts(lambda s: hf_generate(lm, PROMPT, 2, s, stop_ids=set()).tokens)
    assert counts[joint == 0].sum() == 0, "a token outside the top-p nucleus was sampled"
    p = chi2_pvalue(counts, joint)
    assert p > ALPHA, (counts / N_E2E, joint, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_is_torchs_first_index_of_the_largest_in_every_dtype(dtype):
    """sampling.argmax reads a CPU tensor through numpy: the same index as torch.argmax (the first of equal
    largest values), rows and a single row alike, ties made on purpose (half precision makes many)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 4096, generator=gen).mul(4).round().div(4).to(dtype)  # coarse: ties everywhere
    logits[3, 100] = logits[3, 2000] = logits[3].max() + 1  # an exact tie for the top: the first wins
    expected = torch.argmax(logits, dim=-1).tolist()
    assert argmax(logits) == expected and expected[3] == 100
    assert [argmax(row) for row in logits] == expected
    assert argmax(logits[5:9]) == expected[5:9]  # a view of other rows


# ---- logits that are not finite --------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_token_read_from_non_finite_logits_is_refused(bad):
    """argmax lands on a NaN or +inf wherever a row holds one (NaN weights made every token 0): the
    chosen entry's value says so, on the host and in the GPU path's one read alike, for a row, a
    table of rows, verification's ArgmaxRows and a draw."""
    from decoders.core.sampling import ArgmaxRows, NonFiniteLogits, argmax_in_one_read, draw

    rows = torch.randn(4, 50)
    assert argmax_in_one_read(rows) == argmax(rows) and argmax_in_one_read(rows[1]) == argmax(rows[1])
    assert draw(torch.tensor([0.0, 1.0, 0.0]), None) == 1
    rows[2, 17] = bad
    for read in (lambda: argmax(rows), lambda: argmax(rows[2]), lambda: argmax_in_one_read(rows),
                 lambda: ArgmaxRows(rows)[2], lambda: next_token(rows[2], Sampling(), None)):
        with pytest.raises(NonFiniteLogits, match=f"logits are not finite \\({bad}\\)"):
            read()
    assert argmax(rows[[0, 1, 3]]) == argmax_in_one_read(rows[[0, 1, 3]])  # the other rows are untouched
    on_device = ArgmaxRows(rows, top_k=2, also=torch.tensor([1.0]))
    on_device.on_host = False  # the GPU's one read: argmax, the chosen logits, the top tokens, the tree
    with pytest.raises(NonFiniteLogits):
        on_device.slice()
    with pytest.raises(NonFiniteLogits):
        draw(torch.softmax(rows[2] / 0.5, -1), torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteLogits, match="-inf"):
        argmax(torch.full((8,), float("-inf")))  # nothing to choose from


@pytest.mark.parametrize("case", ["random", "one_block", "ties", "small_vocab"])
def test_top_k_rows_has_topks_values(case):
    """top_k_rows (block maxima, then the k best blocks) gives torch.topk's values in its order on rows
    of 262,144 tokens: random rows, rows whose top k all sit in one block (a block's second value beats
    every other block's maximum), rows of ties; a vocabulary too small for blocks takes torch.topk."""
    from decoders.core.sampling import top_k_rows

    g = torch.Generator().manual_seed(0)
    V = 64 if case == "small_vocab" else 262_144
    rows = torch.randn(6, V, generator=g)
    if case == "one_block":
        rows[:, 1024:1032] = 10 + torch.arange(8.0)
    if case == "ties":
        rows = torch.randint(0, 3, (6, V), generator=g).float()
    ids = top_k_rows(rows, 8)
    assert ids.shape == (6, 8)
    assert torch.equal(rows.gather(1, ids), torch.topk(rows, 8).values)
    assert all(len(set(r)) == 8 for r in ids.tolist())
    if case == "one_block":
        assert sorted(ids[0].tolist()) == list(range(1024, 1032))
