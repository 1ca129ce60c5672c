"""model.compile=inductor: the compiled decode-step forward returns what the eager one does (logits,
hidden states, features, the cache it leaves), is traced only while the model loads whatever the
widths and cache lengths that follow, and decoding through it is lossless, like vLLM's e2e
greedy-equality tests. Bad values fail in one line."""
from __future__ import annotations

import json

import pytest
import torch

from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode
from helpers import tiny_lm
from test_greedy_equality import tiny_decoders

GREEDY = Sampling()


@pytest.fixture(scope="module")
def pair():
    """The same random model eager and compiled (compiled once for the module: it takes seconds)."""
    compiled = tiny_lm(seed=0)
    compiled.set_compile("inductor")
    return tiny_lm(seed=0), compiled


@pytest.mark.slow
def test_compiled_at_load_with_its_time_said():
    lm = tiny_lm(seed=1)
    assert lm.compile == "none" and lm.compile_seconds == 0.0
    assert lm.set_compile("inductor") == "inductor" and lm.compile_seconds > 0
    assert lm.compiled.graphs >= 2  # one token, and several
    assert lm.set_compile("none") == "none" and lm.compiled is None


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 2, 3, 5, 8, 17, 64, 70])
def test_compiled_forward_equals_eager(pair, width):
    """Every output kind, tree masks and explicit positions, widths across the graphs' splits and past
    MAX_WIDTH (eager there); the cache each leaves holds the same keys."""
    eager, compiled = pair
    prompt = [3, 9, 4, 1, 7, 2, 11]
    caches = [eager.new_cache(), compiled.new_cache()]
    with torch.inference_mode():
        outs = [lm.forward(prompt, c, features=True) for lm, c in zip(pair, caches)]
        assert close(outs[0][0], outs[1][0]) and close(outs[0][1], outs[1][1])
        n = len(prompt)
        ids = [(5 * i + 1) % 64 for i in range(width)]
        mask = torch.ones(width, n + width, dtype=torch.bool)
        mask[:, n:] = torch.eye(width, dtype=torch.bool) | torch.tril(torch.ones(width, width, dtype=torch.bool), -2)
        pos = torch.arange(n, n + width) // 2 + 1
        for kwargs in (dict(hidden=True, logits_rows=[width - 1, 0]), dict(features=(0, 1)), dict(last_only=True),
                       dict(logits_last=min(width, 3))):
            outs = [lm.forward(ids, c, position_ids=pos, mask=mask, **kwargs) for lm, c in zip(pair, caches)]
            for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in outs)):
                assert a.shape == b.shape and close(a, b), kwargs
            for c in caches:
                c.crop(n)
        outs = [lm.forward(ids, c) for lm, c in zip(pair, caches)]  # causal, default positions
        assert close(*outs)
        for a, b in zip(caches[0].hf.layers, caches[1].hf.layers):
            assert close(a.keys, b.keys) and close(a.values, b.values)


@pytest.mark.slow
def test_nothing_is_traced_after_load(pair):
    """Widths 1-64 and growing caches after the load-time warm-up: no new graph (a trace inside a
    timed run would be charged to it), and the cache stays contiguous after tree edits."""
    _, lm = pair
    graphs, seconds = lm.compiled.graphs, lm.compile_seconds
    cache = lm.new_cache()
    with torch.inference_mode():
        lm.forward(list(range(40)), cache, last_only=True)
        for width in (1, 2, 3, 4, 7, 9, 16, 33, 64, 1, 5):
            n = len(cache)
            lm.forward([7] * width, cache, logits_last=1)
            cache.keep(list(range(n)) + list(range(n + width - 1, n + width)))  # keep the last fed token
            assert all(layer.keys.is_contiguous() for layer in cache.hf.layers)
    assert (lm.compiled.graphs, lm.compile_seconds) == (graphs, seconds)


# A method of each kind of forward: windows and n-gram trees, chains, features (EAGLE), hidden states
# (Medusa), a self-draft running the target's own layers eagerly (Sequoia), and generate() (hf_pld).
DECODERS = ["lookahead-1-5-2", "prompt_lookup-3-1", "eagle-dynamic-10-3-4-seed1", "medusa-list-seed2",
            "recycling-12-2-6", "sequoia-8-4", "hf_pld-3-1"]


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("seed", range(2))
def test_greedy_equality_compiled(pair, name, seed):
    """Decoding through the compiled forward: identical to autoregressive greedy through it, and to
    eager autoregressive (the compiled forward sums in another order: exact here on this model); no
    graph is traced while decoding, called outside inference mode as here or inside it as the bench does."""
    eager, lm = pair
    prompt = torch.randint(0, 64, (4 + 5 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    graphs = lm.compiled.graphs
    reference = autoregressive_decode(lm, prompt, 24, GREEDY, stop_ids=set())
    assert reference.tokens == autoregressive_decode(eager, prompt, 24, GREEDY, stop_ids=set()).tokens
    out = tiny_decoders(name.split("-")[0])[name].generate(lm, prompt, 24, GREEDY, set())
    assert out.tokens == reference.tokens
    assert sum(s.draft_tokens for s in out.steps) > 0
    with torch.inference_mode():
        assert autoregressive_decode(lm, prompt, 24, GREEDY, stop_ids=set()).tokens == reference.tokens
    assert lm.compiled.graphs == graphs


def test_bad_values_fail_in_one_line():
    with pytest.raises(ValueError, match="compile mode 'max' is not one of none, inductor"):
        tiny_lm(seed=0).set_compile("max")
    lm = tiny_lm(seed=0, attn="eager")
    assert lm.set_compile("inductor") == "none" and "sdpa" in lm.compile_note


def test_auto_measures_once_and_keeps_the_faster(tmp_path, monkeypatch):
    """model.compile=auto: measured eager against compiled, compiled kept only 5% cheaper, cached per device and
    model; the cached choice is applied without measuring; a damaged entry is measured again."""
    from bench.models import put_on_fast_path
    from decoders.tuning import profile

    from decoders.core.lm import LM

    costs = iter([0.010, 0.008, 0.010, 0.012])  # eager, then compiled: compiled wins; then eager wins
    monkeypatch.setattr(profile, "step_costs", lambda lm: {"autoregressive_s": next(costs),
                                                            **{f"k{k}_s": 0.0 for k in profile.CHOICE_SIZES}})
    real = LM.set_compile

    def pretend(self, mode):  # the choice is under test here; compiling itself is tested above
        self.compile, self.compile_note = mode, ""
        return mode

    monkeypatch.setattr(LM, "set_compile", pretend)
    lm = tiny_lm(seed=0)
    choice = profile.choose_compile(lm, tmp_path)
    assert choice["chosen"] == "inductor" == lm.compile and "0.80x eager" in choice["why"]
    [entry] = (tmp_path / "compile").glob("*.json")
    again = tiny_lm(seed=0)
    assert profile.choose_compile(again, tmp_path) == choice and again.compile == "inductor"  # not measured
    loaded = tiny_lm(seed=0)
    put_on_fast_path(loaded, loaded.fast_path, str(tmp_path), "auto")  # as a model spec's load() does
    assert loaded.compile == "inductor" and loaded.compile_note.startswith("auto chose inductor: compiled step")
    entry.write_text("{not json")
    assert profile.choose_compile(tiny_lm(seed=0), tmp_path)["chosen"] == "none"  # measured again: eager won
    entry.unlink()
    costs = iter([0.010, 0.0097])  # compiled 3% cheaper: within a sequential measurement's drift, eager kept
    close = profile.choose_compile(tiny_lm(seed=0), tmp_path)
    assert close["chosen"] == "none" and "0.97x eager's (compiled only at 0.95x or less)" in close["why"]
    stale = json.loads(entry.read_text())  # a choice cached under the old rule (the cheaper kept): decided again
    entry.write_text(json.dumps({**stale, "chosen": "inductor", "why": "cached"}))
    assert profile.choose_compile(tiny_lm(seed=0), tmp_path)["chosen"] == "none"
    monkeypatch.setattr(LM, "set_compile", real)
    unsupported = tiny_lm(seed=0, attn="eager")
    monkeypatch.setattr(profile, "step_costs", lambda lm: {"autoregressive_s": 0.01,
                                                            **{f"k{k}_s": 0.0 for k in profile.CHOICE_SIZES}})
    choice = profile.choose_compile(unsupported, tmp_path)
    assert choice["chosen"] == "none" == unsupported.compile and "sdpa" in choice["why"]


def test_auto_falls_back_to_eager_when_the_compiler_fails(tmp_path, monkeypatch):
    from decoders.tuning import profile

    monkeypatch.setattr(profile, "step_costs", lambda lm: {"autoregressive_s": 0.01,
                                                            **{f"k{k}_s": 0.0 for k in profile.CHOICE_SIZES}})
    lm = tiny_lm(seed=0)
    real = lm.set_compile

    def broken(mode):
        if mode == "inductor":
            raise RuntimeError("backend compiler failed\nmore lines")
        return real(mode)

    monkeypatch.setattr(lm, "set_compile", broken)
    choice = profile.choose_compile(lm, tmp_path)
    assert choice["chosen"] == "none" == lm.compile
    assert choice["why"] == "inductor failed: RuntimeError: backend compiler failed"


@pytest.fixture(scope="module")
def hybrid():
    """A tiny Gemma 3 (sliding and full layers: a mask per layer type; tied embeddings, QK-norm), compiled."""
    from test_model_families import family_lm

    lm = family_lm("gemma3")
    lm.set_compile("inductor")
    yield family_lm("gemma3", "none"), lm
    lm.set_compile("none")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lookahead-1-5-2", "eagle-dynamic-10-3-4-seed1", "recycling-12-2-6",
                                  "medusa-list-seed2"])
def test_greedy_equality_compiled_on_a_hybrid_model(hybrid, name):
    """The compiled graph takes the masks by layer type past the window: decoding through it equals
    eager autoregressive, and no graph is traced while decoding (a draft reading the tied head leaves the
    target's weights as the graph saw them)."""
    from test_model_families import NEW, prompt

    eager, lm = hybrid
    graphs = lm.compiled.graphs
    reference = autoregressive_decode(eager, prompt(), NEW, GREEDY, stop_ids=set())
    assert autoregressive_decode(lm, prompt(), NEW, GREEDY, stop_ids=set()).tokens == reference.tokens
    out = tiny_decoders(name.split("-")[0])[name].generate(lm, prompt(), NEW, GREEDY, set())
    assert out.tokens == reference.tokens and sum(s.draft_tokens for s in out.steps) > 0
    assert lm.compiled.graphs == graphs
