"""spec_chain internals: both KV caches hold exactly the committed tokens, the trace's draft
counts, and speculative sampling's output distribution (chi-square against the exact joint,
with a negative control). Greedy equality is in test_greedy_equality.py."""
import pytest
import torch

import decoders.core.loop as loop_module  # the loop verifies; negative controls patch it there
import decoders.methods.spec_chain as spec_chain_module
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.draft_model import SelfDraft
from decoders.core.sampling import Sampling
from decoders.methods.spec_chain import SpecChain
from helpers import chi2_pvalue, tiny_lm
from test_lookahead import ALPHA, LENGTH, N_CONTROL, N_SAMPLES, assert_matches_exact, exact_joint, sample_counts
from test_lookahead import stat_model  # noqa: F401  (fixture)

GREEDY = Sampling()


def assert_cache_equals_fresh_forward(model, cache, tokens):
    fresh = model.new_cache()
    model.forward(tokens, fresh)
    for a, b in zip(cache.hf.layers, fresh.hf.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 3, 6])
def test_both_caches_hold_only_committed_tokens(monkeypatch, seed, k):
    """At every step's start, the target cache equals a fresh forward of every committed token
    but the last (fed with the drafts), and the draft cache a fresh forward of a prefix of them:
    rejected drafts leave nothing behind in either."""
    lm = tiny_lm(seed=seed, layers=3)
    decoder = SpecChain(draft=SelfDraft(layers=1), depth=k)
    decoder.load_addons(lm)  # the draft, built before the target's new_cache is spied on
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    target_caches = []
    make_cache = lm.new_cache
    monkeypatch.setattr(lm, "new_cache", lambda **kw: target_caches.append(make_cache(**kw)) or target_caches[-1])
    checked = []
    draft_chain = spec_chain_module.draft_chain

    def checking_draft_chain(draft_lm, cache, sequence, n, *args):
        target = target_caches[0]
        assert len(target) == len(sequence) - 1
        assert_cache_equals_fresh_forward(lm, target, list(sequence[:-1]))
        assert len(cache) <= len(sequence) - 1
        if len(cache):  # empty before the first draft step
            assert_cache_equals_fresh_forward(draft_lm, cache, list(sequence[:len(cache)]))
        checked.append(len(sequence))
        return draft_chain(draft_lm, cache, sequence, n, *args)

    monkeypatch.setattr(spec_chain_module, "draft_chain", checking_draft_chain)
    out = decoder.generate(lm, prompt, 30, GREEDY, set())
    monkeypatch.undo()
    assert out.tokens == autoregressive_decode(lm, prompt, 30, GREEDY, set()).tokens
    assert len(checked) >= 3 and checked == sorted(checked)


def test_trace_counts_drafts_and_acceptance():
    lm = tiny_lm(seed=1, layers=3)
    out = SpecChain(draft=SelfDraft(layers=2), depth=4).generate(lm, [1, 2, 3], 40, GREEDY, set())
    steps = out.steps
    assert steps[0].draft_tokens == 0 and steps[0].committed == 1  # the prefill
    for s in steps[1:]:
        assert s.forward_tokens == s.draft_tokens + 1  # root + the chain
        assert 1 <= s.draft_tokens <= 4
        assert s.committed == min(s.info["accepted_depth"] + 1, s.committed)
        assert s.accepted_draft_tokens == s.info["accepted_depth"]
        assert s.draft_forward_tokens >= s.draft_tokens  # catch-up tokens + k - 1 chained ones
        assert s.draft_flops > 0
    assert sum(s.committed for s in steps) == len(out.tokens) == 40
    # The last step never drafts past max_new_tokens.
    assert steps[-1].draft_tokens <= 40 - sum(s.committed for s in steps[:-1]) - 1


def test_a_draft_equal_to_the_target_accepts_everything():
    """With the target as its own draft every greedy draft is accepted: k + 1 tokens per step."""
    lm = tiny_lm(seed=2, layers=2)

    class Same:
        def build(self, target):
            return target

    out = SpecChain(draft=Same(), depth=3).generate(lm, [5, 6], 33, GREEDY, set())
    assert [s.committed for s in out.steps] == [1] + [4] * 8
    assert out.tokens == autoregressive_decode(lm, [5, 6], 33, GREEDY, set()).tokens


def test_errors():
    with pytest.raises(ValueError, match="decoder.depth"):
        SpecChain(draft=SelfDraft(), depth=0)
    with pytest.raises(ValueError, match="decoder.draft is required"):
        SpecChain(draft=None)
    lm = tiny_lm(seed=0, layers=2)
    with pytest.raises(ValueError, match=r"draft.layers must be an integer in \[1, 1\]"):
        SpecChain(draft=SelfDraft(layers=2)).generate(lm, [1], 5, GREEDY, set())


SAMPLED_CASES = {
    # name: (layers of the self-draft, k, sampling, the wrong sampling of the negative control)
    "chain-k2-t0.7": (1, 2, dict(temperature=0.7), dict(temperature=1.0)),
    "chain-k4-t1.0": (1, 4, dict(temperature=1.0), dict(temperature=0.7)),
    "chain-k3-t1.0-topp0.9": (1, 3, dict(temperature=1.0, top_p=0.9), dict(temperature=1.0)),
    "chain-k2-t0.7-topk3": (1, 2, dict(temperature=0.7, top_k=3), dict(temperature=0.7)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", SAMPLED_CASES)
def test_sampling_matches_exact_distribution(stat_model, case):  # noqa: F811
    lm, prompt = stat_model
    layers, k, kwargs, wrong = SAMPLED_CASES[case]
    decoder = SpecChain(draft=SelfDraft(layers=layers), depth=k)
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), kwargs, N_SAMPLES)
    assert hit_share >= 0.1, f"drafts accepted in only {hit_share:.0%} of steps: the test proves little"
    assert_matches_exact(lm, prompt, counts, kwargs, wrong)


def _accept_all(tree, target_probs, draft_probs, generator, without_replacement=False, draws=None):
    """WRONG: accepts every draft token (the draft's distribution leaks into the output)."""
    path = list(range(len(tree)))
    return path, int(torch.multinomial(target_probs[path[-1]], 1, generator=generator))


@pytest.mark.slow
def test_negative_control_a_verifier_that_accepts_every_draft_is_rejected(stat_model, monkeypatch):  # noqa: F811
    lm, prompt = stat_model
    monkeypatch.setattr(loop_module, "verify_sampling", _accept_all)
    kwargs = dict(temperature=0.8)
    decoder = SpecChain(draft=SelfDraft(layers=1), depth=2)
    counts, _ = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), kwargs, N_CONTROL)
    assert chi2_pvalue(counts, exact_joint(lm, prompt, Sampling(**kwargs))) < ALPHA
