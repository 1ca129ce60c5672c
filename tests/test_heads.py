"""Medusa heads, Medusa's tree, BPD's lattice rescoring and the n-gram LM.

Greedy equality for medusa and bpd over settings lives in test_greedy_equality.py (untrained
and random heads); here heads trained on a tiny model's own output make multi-token
acceptance common, so exactness is tested where it matters (EOS and max_new_tokens inside an
accepted block), and the sampling path is tested against the exact distribution.
"""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.bpd import BPD, NeuralScorer, lattice_beam_search
from decoders.methods.draft_model import SelfDraft
from bench.prompts import render
from decoders.methods.heads import Heads, heads_for, load_heads, new_heads, restrict_readout, save_heads
from decoders.core.tree import best_paths, prior_accuracy, rank_tree
from decoders.methods.medusa import Medusa, typical_accept
from decoders.tuning.tree_size import choose_size, expected_tokens
from decoders.methods.ngram_lm import NgramLM
from decoders.core.sampling import Sampler, Sampling
from decoders.core.tree import TokenTree
from helpers import REPO, assert_stored_in_half, script_module, chi2_pvalue, round_to_half, tiny_lm
from test_greedy_equality import check_trace
from test_lookahead import ALPHA, LENGTH, N_SAMPLES, exact_joint, sample_counts, stat_model  # noqa: F401

accuracy = script_module("scripts/train_heads.py").accuracy

GREEDY = Sampling()


def own_text(lm, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(0, lm.vocab_size, (6,), generator=g).tolist()
        out.append(prompt + autoregressive_decode(lm, prompt, length, GREEDY, set()).tokens)
    return out


class OracleHeads(Heads):
    """Heads that know the autoregressive continuation: the hidden state is matched to its
    position in prompt + reference (nearest row of a full forward), and head i ranks the token
    at t + i + 2 first, except at positions where (t + i) % miss == 0, where it ranks it second
    (so rank-1 branches of a tree matter) or, when (t + i) % (2 miss) == 0, nowhere in the top 4."""

    def __init__(self, lm, sequence: list[int], k: int = 3, miss: int = 3):
        super().__init__(lm.model.get_output_embeddings(), lm.config.hidden_size, k)
        _, self.table = lm.forward(sequence, lm.new_cache(), hidden=True)
        self.sequence, self.vocab, self.miss = sequence, lm.vocab_size, miss
        self.info = {"accuracy": [[0.6, 0.3, 0.05, 0.05]] * k}

    def forward(self, hidden):
        t = int(torch.cdist(hidden[None].float(), self.table.float()).argmin())
        logits = -torch.arange(self.vocab, dtype=torch.float32).repeat(self.k, 1) / self.vocab
        for i in range(self.k):
            if t + i + 2 >= len(self.sequence):
                continue
            token = self.sequence[t + i + 2]
            logits[i, token] = -5.0 if (t + i) % (2 * self.miss) == 0 else (
                logits[i].max() - 1e-3 if (t + i) % self.miss == 0 else 10.0)
            if (t + i) % self.miss == 0 and (t + i) % (2 * self.miss):
                logits[i, (token + 1) % self.vocab] = 10.0  # a wrong token ranks first
        return logits


def with_oracle(decoder, lm, prompt, reference):
    oracle = OracleHeads(lm, prompt + reference)
    decoder._heads.get(lm, lambda: (oracle, {}))  # a fresh decoder: the oracle is its heads for lm
    return decoder


@pytest.fixture(scope="module")
def tiny_ngram(tmp_path_factory):
    lm = tiny_lm(seed=3)
    path = tmp_path_factory.mktemp("ngram") / "ngram.json.gz"
    NgramLM.train(own_text(lm, 32, 40, seed=7), 3, lm.vocab_size, min_count=1).save(path, {})
    return str(path)


NAMES = ["medusa-auto-16", "medusa-chain", "medusa-prior-8", "medusa-list", "bpd", "bpd-block2", "bpd-none-p3",
         "bpd-ngram-p1", "bpd-ngram-p4", "bpd-neural-p2"]


def make(name: str, ngram: str):
    return {
        "medusa-auto-16": lambda: Medusa(tree_size=16, num_heads=3),
        "medusa-chain": lambda: Medusa(choices="chain", num_heads=3),
        "medusa-prior-8": lambda: Medusa(choices="prior", tree_size=8, num_heads=3),
        "medusa-list": lambda: Medusa(choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], num_heads=3),
        "bpd": lambda: BPD(num_heads=3),
        "bpd-block2": lambda: BPD(num_heads=3, block=2),
        "bpd-none-p3": lambda: BPD(num_heads=3, paths=3, ranks_per_head=3),
        "bpd-ngram-p1": lambda: BPD(num_heads=3, rescore="ngram", ngram=ngram),
        "bpd-ngram-p4": lambda: BPD(num_heads=3, rescore="ngram", ngram=ngram, paths=4, weight=0.5),
        "bpd-neural-p2": lambda: BPD(num_heads=3, rescore="neural", draft=SelfDraft(layers=1), paths=2),
    }[name]()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(4))
def test_oracle_heads_are_accepted_and_output_is_exact(tiny_ngram, name, seed):
    """Heads that are often right make multi-token steps common, so exactness is tested where it
    matters: accepted blocks cut by max_new_tokens, and rank-1 branches."""
    lm = tiny_lm(seed=3)
    prompt = own_text(lm, 1, 0, seed + 50)[0]
    for max_new in (1, 5, 33):
        reference = autoregressive_decode(lm, prompt, max_new, GREEDY, set()).tokens
        out = with_oracle(make(name, tiny_ngram), lm, prompt, reference).generate(lm, prompt, max_new, GREEDY, set())
        assert out.tokens == reference, (name, max_new)
        check_trace(out, max_new, set())
    assert sum(s.accepted_draft_tokens for s in out.steps) >= 8, name
    for s in out.steps[1:]:
        assert s.forward_tokens == s.info["tree_size"] == s.draft_tokens + 1
        assert s.accepted_draft_tokens <= s.info["accepted_depth"] <= s.info["draft_depth"]
        assert s.info["head_flops"] > 0 and s.draft_flops >= s.info["head_flops"]
        assert (s.info["rescore_flops"] > 0) == name.startswith("bpd-neural")
    assert max(s.info["accepted_depth"] for s in out.steps[1:]) >= 2


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(4))
def test_eos_inside_an_accepted_block(tiny_ngram, name, seed):
    lm = tiny_lm(seed=3)
    prompt = own_text(lm, 1, 0, seed + 60)[0]
    free = autoregressive_decode(lm, prompt, 30, GREEDY, set()).tokens
    eos = free[min(len(free) - 1, 2 + 4 * seed)]
    reference = autoregressive_decode(lm, prompt, 30, GREEDY, {eos})
    out = with_oracle(make(name, tiny_ngram), lm, prompt, free).generate(lm, prompt, 30, GREEDY, {eos})
    assert out.tokens == reference.tokens and out.stop_reason == "eos"
    check_trace(out, 30, {eos})


def test_shipped_heads_beat_untrained_ones_on_real_prompts(smollm, data_dir):
    """The heads scripts/train_heads.py made for SmolLM2, on HumanEval and GSM8K text the model
    writes itself (none of it seen in training): head 0's top-1 accuracy is far above an untrained head's."""
    from bench.datasets import GSM8K, HumanEval

    texts = []
    for prompt in HumanEval(limit=2).load() + GSM8K(limit=2, data_dir=str(data_dir)).load():
        _, ids = render(smollm.tokenizer, prompt, 0, [], "chat")
        texts.append(ids + autoregressive_decode(smollm, ids, 48, GREEDY, smollm.stop_ids).tokens)
    shipped = load_heads(smollm, REPO / "adapters" / "smollm2-135m-heads4.safetensors")
    trained = accuracy(smollm, shipped, texts, ranks=1)
    untrained = accuracy(smollm, new_heads(smollm, shipped.k), texts, ranks=1)
    assert trained[0][0] > untrained[0][0] + 0.15, (trained, untrained)
    assert shipped.info["accuracy"][0][0] > shipped.info["accuracy_untrained"][0][0]


@pytest.mark.parametrize("shipped",
                         ["adapters/smollm2-135m-heads4.safetensors", "adapters/smollm2-135m-eagle.safetensors",
                                     "adapters/smollm2-135m-self4.safetensors", "adapters/smollm2-135m-ngram4.json.gz",
                                     "adapters/smollm2-135m-dflash.safetensors",
                                     "adapters/gemma3-270m-heads4.safetensors",
                                     "adapters/gemma3-270m-self4.safetensors", "adapters/gemma3-270m-ngram4.json.gz",
                                     "adapters/gemma3-270m-dflash.safetensors"])
def test_shipped_addons_are_found_from_any_working_directory(tmp_path, monkeypatch, shipped):
    """The configs name the shipped add-ons relative to the repository; a run started elsewhere finds them."""
    from decoders.core.weights_file import addon_path

    monkeypatch.chdir(tmp_path)
    assert addon_path(shipped) == REPO / shipped and addon_path(shipped).is_file()
    assert SelfDraft(layers=4, adapter=shipped).adapter_path() == REPO / shipped
    assert addon_path(tmp_path / "x.safetensors") == tmp_path / "x.safetensors"  # an absolute path is kept


# How each shipped add-on is stored (adapters/README.md's table): int8 where that measured neutral for
# acceptance (the heads, the exit adapters, Gemma's block draft), float16 elsewhere (the EAGLE draft lost 2% of its
# tokens per step in int8).
STORED_INT8 = ["adapters/smollm2-135m-heads4.safetensors", "adapters/smollm2-135m-self4.safetensors",
               "adapters/gemma3-270m-heads4.safetensors", "adapters/gemma3-270m-self4.safetensors",
               "adapters/gemma3-270m-dflash.safetensors"]
STORED_HALF = ["adapters/smollm2-135m-eagle.safetensors", "adapters/smollm2-135m-dflash.safetensors"]


@pytest.mark.parametrize("shipped", STORED_INT8 + STORED_HALF)
def test_shipped_add_ons_are_stored_as_the_table_says(shipped):
    """An int8 file holds every weight matrix (2-D, 4096 values or more) in int8 with a float16 scale
    per row, and the rest in float16; the others hold float16 only."""
    from safetensors import safe_open

    from decoders.core.weights_file import INT8, INT8_MIN_ELEMENTS

    if shipped in STORED_HALF:
        assert_stored_in_half(REPO / shipped)
        return
    with safe_open(str(REPO / shipped), "pt") as f:
        int8 = json.loads(f.metadata()[INT8])
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    matrices = [k for k, shape in shapes.items() if not k.endswith(".scale") and len(shape) == 2
                and math.prod(shape) >= INT8_MIN_ELEMENTS]
    assert matrices and sorted(int8) == sorted(matrices), (int8, matrices)
    assert all(dtypes[k] == "I8" and dtypes[k + ".scale"] == "F16" for k in int8), dtypes
    assert {d for k, d in dtypes.items() if k not in int8} == {"F16"}, dtypes


def test_heads_file_round_trip_and_errors(tmp_path):
    lm = tiny_lm(seed=0, fast_path="none")  # the native path both sides: a fast path would round otherwise
    heads = new_heads(lm, 2, seed=5)
    round_to_half(heads)
    save_heads(heads, tmp_path / "h.safetensors", {"accuracy": [[0.5], [0.25]]})
    assert_stored_in_half(tmp_path / "h.safetensors")
    loaded = load_heads(lm, tmp_path / "h.safetensors")
    h = torch.randn(3, 64)
    assert torch.equal(loaded(h), heads(h)) and loaded.k == 2 and loaded.accuracy() == [[0.5], [0.25]]
    assert heads(h).shape == (2, 3, 64)
    with pytest.raises(FileNotFoundError, match="train_heads.py"):
        load_heads(lm, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="hidden size 64"):
        load_heads(tiny_lm(seed=0, hidden=32), tmp_path / "h.safetensors")


def test_add_ons_stored_in_int8_load_within_half_a_step_and_decode_exactly(tmp_path, capsys):
    """scripts/store_int8.py: heads, an EAGLE draft, an exit adapter (and an EAGLE-3 directory) with
    their weight matrices in int8 (one float16 scale per row) take about half the float16 file's bytes;
    every loader reads them back within half a step of each row's scale (norms and biases untouched),
    and decoding with them is exact. A file whose metadata names an int8 matrix it lacks is one line."""
    from safetensors.torch import save_file
    from store_int8 import main as store_int8

    from decoders.core.weights_file import load_weights
    from decoders.methods.draft_model import new_exit_adapter, save_adapter
    from decoders.methods.eagle import Eagle
    from decoders.methods.eagle_draft import load_draft, new_draft, save_draft
    from decoders.methods.spec_chain import SpecChain

    lm = tiny_lm(seed=0, fast_path="none")
    adapter = new_exit_adapter(lm.model, 1)
    torch.nn.init.normal_(adapter.proj.weight, std=0.2)
    made = {"heads": (new_heads(lm, 2, seed=5), lambda m, p: save_heads(m, p, {}), "medusa-heads-v1"),
            "eagle": (new_draft(lm, seed=3), lambda m, p: save_draft(m, p, {}), "eagle-draft-v1"),
            "adapter": (adapter, lambda m, p: save_adapter(m, p, 1, {}), "exit-adapter-v1")}
    reference = autoregressive_decode(lm, [3, 4, 5] * 3, 16, Sampling(), set()).tokens
    for name, (module, save, fmt) in made.items():
        round_to_half(module)
        half, int8 = tmp_path / f"{name}.safetensors", tmp_path / f"{name}-int8.safetensors"
        save(module, half)
        store_int8([str(half), "--out", str(int8)])
        assert int8.stat().st_size < 0.6 * half.stat().st_size, name
        meta, back = load_weights(int8, fmt, "key", "file", "")
        quantized = json.loads(meta["int8"])
        for key, value in module.state_dict().items():
            if key in quantized:
                step = value.float().abs().amax(1, keepdim=True) / 127
                assert ((back[key] - value.float()).abs() <= step / 2 + 1e-3 * step).all(), (name, key)
                assert not torch.equal(back[key], value.float()), (name, key)  # rounded: the check has power
            else:
                assert torch.equal(back[key], value), (name, key)
        assert quantized, name
    decoders = {"heads": Medusa(heads=str(tmp_path / "heads-int8.safetensors"), readout_vocab="full"),
                "eagle": Eagle(draft_weights=str(tmp_path / "eagle-int8.safetensors"), tree_size=8, depth=3),
                "adapter": SpecChain(draft=SelfDraft(layers=1, adapter=str(tmp_path / "adapter-int8.safetensors")))}
    for name, decoder in decoders.items():
        assert decoder.generate(lm, [3, 4, 5] * 3, 16, Sampling(), set()).tokens == reference, name
    assert load_draft(lm, tmp_path / "eagle-int8.safetensors").fuse.weight.dtype == torch.float32
    # An EAGLE-3 draft trained here, in the authors' layout: its model.safetensors in int8, config.json copied.
    from decoders.methods.published import new_eagle3, save_eagle3

    deep = tiny_lm(seed=0, layers=8, fast_path="none")
    draft = new_eagle3(deep, vocab=[1, 5, 9, 20, 33, 60])
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape) * 0.3)
    round_to_half(draft)
    save_eagle3(draft, tmp_path / "e3", {"accuracy": [[0.5]]}, "model")
    store_int8([str(tmp_path / "e3"), "--out", str(tmp_path / "e3-int8")])
    assert (tmp_path / "e3-int8" / "config.json").read_text() == (tmp_path / "e3" / "config.json").read_text()
    back = load_draft(deep, tmp_path / "e3-int8")
    step = draft.fc.weight.float().abs().amax(1, keepdim=True) / 127
    assert ((back.fc.weight - draft.fc.weight).abs() <= step / 2 + 1e-3 * step).all() and back.accuracy() == [[0.5]]
    reference = autoregressive_decode(deep, [3, 4, 5] * 3, 16, Sampling(), set()).tokens
    assert Eagle(draft_weights=str(tmp_path / "e3-int8"), tree_size=8, depth=3).generate(
        deep, [3, 4, 5] * 3, 16, Sampling(), set()).tokens == reference
    state = {"blocks.0.linear.weight": torch.zeros(64, 64, dtype=torch.int8)}
    save_file(state, str(tmp_path / "bad.safetensors"), metadata={"format": "medusa-heads-v1", "int8": '["x"]'})
    with pytest.raises(ValueError, match="records int8 matrices it does not hold with their scales"):
        load_weights(tmp_path / "bad.safetensors", "medusa-heads-v1", "decoder.heads", "heads file", "")


def test_untrained_heads_repeat_the_models_next_token_prediction():
    lm = tiny_lm(seed=1)
    logits, hidden = lm.forward([1, 2, 3], lm.new_cache(), hidden=True)
    heads = new_heads(lm, 3)
    assert torch.allclose(heads(hidden), logits.expand(3, -1, -1), atol=1e-5)


# ---- a reduced readout vocabulary ----------------------------------------------------------------
def vocab_file(path, tokens, model="model", vocab_size=64, **extra):
    from decoders.core.weights_file import VOCAB_FORMAT

    path.write_text(json.dumps({"format": VOCAB_FORMAT, "model": model, "vocab_size": vocab_size,
                                "tokens": tokens, "heldout_coverage": 0.9, **extra}))
    return str(path)


SUBSET = list(range(0, 64, 3)) + [1, 5]  # 24 of tiny_lm's 64 tokens


@pytest.mark.parametrize("own_outputs", [False, True])
def test_a_restricted_readout_scores_its_vocabulary_as_the_full_one_and_nothing_else(own_outputs):
    lm = tiny_lm(seed=0)
    heads = (new_heads(lm, 3, seed=2) if not own_outputs else
             Heads(lm.model.get_output_embeddings(), 64, 3, layers=2, own_outputs=True).requires_grad_(False))
    h = torch.randn(2, 64)
    full, flops = heads(h), heads.flops()
    restrict_readout(lm, heads, SUBSET)
    small = heads(h)
    inside = torch.zeros(64, dtype=torch.bool)
    inside[SUBSET] = True
    assert small.shape == full.shape and torch.allclose(small[..., inside], full[..., inside], atol=1e-5)
    assert bool(torch.isneginf(small[..., ~inside]).all())
    d = 64 * 64 * 2.0 * heads.layers * heads.k
    assert (heads.flops() - d) * 64 == pytest.approx((flops - d) * len(SUBSET))  # readout rows: 24 of 64


@pytest.mark.parametrize("name", ["medusa-auto-16", "medusa-chain", "bpd", "bpd-ngram-p4"])
@pytest.mark.parametrize("seed", range(3))
def test_heads_with_a_restricted_readout_stay_exact(tiny_ngram, tmp_path, name, seed):
    """Random heads over 24 of 64 tokens: candidates outside can never be drafted, the output is
    still autoregressive greedy's, and tuning reports the readout."""
    lm = tiny_lm(seed=3)
    decoder = make(name, tiny_ngram)
    decoder.heads_seed, decoder.readout_vocab = seed, vocab_file(tmp_path / "v.json", SUBSET)
    prompt = own_text(lm, 1, 0, seed + 70)[0]
    reference = autoregressive_decode(lm, prompt, 40, GREEDY, set()).tokens
    out = decoder.generate(lm, prompt, 40, GREEDY, set())
    assert out.tokens == reference
    check_trace(out, 40, set())
    assert decoder.tuning["readout_vocab"] == len(SUBSET) and decoder.tuning["readout_coverage"] == 0.9


def test_draft_vocab_coverage_counts_the_targets_greedy_tokens():
    greedy_coverage = script_module("scripts/draft_vocab.py").greedy_coverage

    lm = tiny_lm(seed=0)
    seqs = own_text(lm, 2, 10, seed=1)
    greedy = {int(t) for s in seqs for t in lm.forward(s, lm.new_cache()).argmax(-1)}
    assert greedy_coverage(lm, sorted(greedy), seqs) == 1.0
    assert greedy_coverage(lm, sorted(set(range(64)) - greedy), seqs) == 0.0
    one = min(greedy)
    hits = sum(int(t) == one for s in seqs for t in lm.forward(s, lm.new_cache()).argmax(-1))
    assert greedy_coverage(lm, [one], seqs) == pytest.approx(hits / sum(map(len, seqs)))


def test_readout_vocab_choices_and_errors(tmp_path):
    from decoders.core.weights_file import load_vocab

    lm = tiny_lm(seed=0)
    assert load_vocab(lm, "auto") == (None, {"readout_vocab": 64})  # no adapters/model-vocab.json: all of it
    assert load_vocab(lm, "full") == load_vocab(lm, None) == (None, {"readout_vocab": 64})
    tokens, info = load_vocab(lm, vocab_file(tmp_path / "v.json", [9, 3, 4]))
    assert tokens == [3, 4, 9] and info == {"readout_vocab": 3, "readout_coverage": 0.9}
    assert heads_for(lm, None, 2, 0, readout_vocab=str(tmp_path / "v.json"))[0].readout_ids.tolist() == [3, 4, 9]
    (tmp_path / "x.json").write_text("{")
    (tmp_path / "f.json").write_text("[1, 2]")
    bad = {"missing": (str(tmp_path / "none.json"), "no vocabulary file at"),
           "not json": (str(tmp_path / "x.json"), "could not be read"),
           "format": (str(tmp_path / "f.json"), "is not a draft-vocab-v1"),
           "range": (vocab_file(tmp_path / "r.json", [1, 64]), r"distinct token ids in \[0, 64\)"),
           "repeated": (vocab_file(tmp_path / "d.json", [1, 1]), "distinct token ids"),
           "other model": (vocab_file(tmp_path / "o.json", [1], model="llama"), "made for base model llama"),
           "other vocab": (vocab_file(tmp_path / "w.json", [1], vocab_size=99), "vocabulary of 99 tokens")}
    for what, (spec, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            load_vocab(lm, spec)
    assert load_vocab(lm, str(tmp_path / "o.json"), check_base=False)[0] == [1]


# ---- Medusa's tree -----------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 5, 20, 60])
def test_best_paths_are_the_top_products_and_prefix_closed(size):
    acc = [[0.7, 0.2, 0.05], [0.5, 0.3, 0.1], [0.4, 0.2, 0.1]]
    paths = best_paths(acc, size, top_k=3)
    value = {p: math.prod(acc[i][r] for i, r in enumerate(p))
             for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)}
    assert len(paths) == min(size, len(value))
    cut = sorted(value.values(), reverse=True)[len(paths) - 1]
    assert all(value[p] >= cut - 1e-12 for p in paths)
    assert all(p[:-1] in set(paths) | {()} for p in paths)  # closed under prefixes
    parents, slots = rank_tree(paths)
    assert (len(parents) == len(paths) + 1
            and [h for h, _ in slots] == [len(p) - 1 for p in sorted(paths, key=lambda p: (len(p), p))])


def test_choices_validation():
    with pytest.raises(ValueError, match="no parent path"):
        Medusa(choices=[[0], [1, 0]])
    with pytest.raises(ValueError, match="choices must be"):
        Medusa(choices="wide")
    with pytest.raises(ValueError, match="tree_size must be an integer >= 1"):
        Medusa(tree_size=0)
    with pytest.raises(ValueError, match="accept_rule must be one of exact, typical"):
        Medusa(accept_rule="loose")
    lm = tiny_lm(seed=0)
    with pytest.raises(ValueError, match="depth 3 needs that many heads"):
        Medusa(num_heads=2, choices=[[0], [0, 0], [0, 0, 0]]).generate(lm, [1, 2], 5, GREEDY, set())
    assert Medusa(choices="prior").paths(new_heads(lm, 2))[1] == "prior"
    assert best_paths(prior_accuracy(2, 3), 4, 3) == [(0,), (1,), (2,), (0, 0)]  # by depth, then rank


ACCURACY = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]  # head i's rank-r accuracy


@pytest.mark.parametrize("slope, heads_cost, expected_size", [
    (0.0, 0.0, 32),   # verification free: the biggest tree buys the most
    (1.0, 0.0, 1),    # every token fed costs a whole step: one candidate
    (0.1, 0.0, 4),    # a steep curve: a small tree
    (0.1, 3.0, 8),    # dear heads are paid once a step: a bigger tree amortises them
    (0.05, 0.0, 8),
    (0.05, 5.0, 16),
])
def test_medusa_auto_size_is_the_most_tokens_per_unit_of_time(slope, heads_cost, expected_size):
    """tree_size=auto: of auto_sizes, the size whose forecast tokens per step over its cost (a
    forward of size + 1 tokens plus the heads, in autoregressive steps) is largest."""
    def cost(k):
        return 1.0 + slope * (k - 1)

    sizes = [1, 2, 4, 8, 16, 32]
    size, info, table = choose_size(ACCURACY, 3, sizes, cost, lambda depth: heads_cost)
    assert size == expected_size and [row["tree_size"] for row in table] == sizes
    for row in table:  # each forecast is the tree's own: the root (+1) and the heads in the cost
        paths = best_paths(ACCURACY, row["tree_size"], 3)
        assert row["expected_tokens"] == expected_tokens(ACCURACY, paths)
        assert row["step_cost"] == cost(row["tree_size"] + 1) + heads_cost
    assert info["predicted_speedup"] == max(row["predicted_speedup"] for row in table)
    assert info["draft_cost"] == heads_cost


def test_medusa_auto_size_on_a_model_reports_its_choice(tmp_path):
    lm = tiny_lm(seed=0)
    medusa = Medusa(num_heads=3, heads_seed=1, choices="prior", tree_size="auto", auto_sizes=[1, 4, 16],
                    cache_dir=str(tmp_path))
    gen = medusa.generate(lm, [1, 2, 3], 12, GREEDY, set())
    assert gen.tokens == autoregressive_decode(lm, [1, 2, 3], 12, GREEDY, set()).tokens
    # the size it reports is the tree it verified (the root and tree_size nodes a step, after the prefill)
    assert max(step.forward_tokens for step in gen.steps[1:]) == medusa.tuning["tree_size"] + 1
    assert medusa.tuning["predicted_speedup"] > 0
    assert medusa.tuning["heads_cost"] > 0 and list((tmp_path / "latency").glob("*.json"))  # the profile, cached
    with pytest.raises(ValueError, match="tree_size must be an integer >= 1 or auto"):
        Medusa(tree_size="big")
    with pytest.raises(ValueError, match="auto_sizes"):
        Medusa(auto_sizes=[])


def test_typical_acceptance_is_lossy_and_follows_its_threshold():
    # root -> 1, root -> 2 -> 3, root -> 6
    tree = TokenTree([5, 1, 2, 3, 6], [-1, 0, 0, 2, 0])
    logits = torch.full((5, 8), -10.0)
    logits[0, 1], logits[0, 2] = 2.0, 1.9  # tokens 1 and 2 nearly tied after the root; 6 implausible
    logits[2, 3] = 5.0  # after 2, token 3 is nearly certain
    logits[3, 7] = 3.0
    path, bonus = typical_accept(tree, logits, Sampler(GREEDY, "cpu"), threshold=0.09, alpha=0.3)
    assert path == [0, 2, 3] and bonus == 7  # token 2 is not the argmax: greedy would stop at [0, 1]
    # a higher bar (0.5 here: alpha exp(-entropy)) rejects token 2 (p 0.475) but never the argmax (p >= exp(-H))
    path, _ = typical_accept(tree, logits, Sampler(GREEDY, "cpu"), threshold=0.9, alpha=1.0)
    assert path == [0, 1]
    assert Medusa(accept_rule="typical").lossless is False and Medusa().lossless is True


# ---- BPD: lattice and rescoring -------------------------------------------------------------
def test_lattice_beam_search_with_full_width_is_exhaustive():
    g = torch.Generator().manual_seed(0)
    head_logp = torch.log_softmax(torch.randn(3, 10, generator=g), -1)
    lm_scores = torch.randn(10, generator=g)

    def score_next(paths, parent, cand):  # a context-dependent LM: depends on the beam's last token
        return torch.stack([torch.roll(lm_scores, len(b) and b[-1])[cand] for b in paths.tolist()])

    best = lattice_beam_search(head_logp, 3, 27, 0.7, score_next)
    top = torch.topk(head_logp, 3).indices.tolist()

    def total(path):
        s = 0.0
        for i, t in enumerate(path):
            prev = path[i - 1] if i else None
            s += float(head_logp[i, t]) + 0.7 * float(torch.roll(lm_scores, prev or 0)[t])
        return s
    every = sorted(itertools.product(*top), key=total, reverse=True)
    assert best[0] == every[0] and set(best) == set(every)
    # width 1 without an LM is each position's top-1: plain BPD
    assert lattice_beam_search(head_logp, 3, 1, 1.0, None) == [tuple(t[0] for t in top)]


def test_ngram_lm_stupid_backoff_and_file(tmp_path):
    ng = NgramLM.train([[1, 2, 3, 1, 2, 4, 1, 2, 3]], order=3, vocab_size=10, min_count=1)
    assert ng.score([1, 2], 3) == pytest.approx(math.log(2 / 3))  # seen trigram
    assert ng.score([4, 2], 3) == pytest.approx(math.log(0.4 * 2 / 3))  # unseen context: the bigram 2 -> 3
    assert ng.score([9, 9], 5) == pytest.approx(math.log(0.4 * 0.4 * 1 / (9 + 10)))  # add-one unigram
    ng.save(tmp_path / "n.json.gz", {"note": 1})
    back = NgramLM.load(tmp_path / "n.json.gz")
    assert back.score([1, 2], 4) == ng.score([1, 2], 4) and back.info == {"note": 1}
    # shared: one load per process while the file stays the same; a rewritten file is read again
    assert NgramLM.shared(tmp_path / "n.json.gz") is NgramLM.shared(tmp_path / "n.json.gz")
    first = NgramLM.shared(tmp_path / "n.json.gz")
    ng.save(tmp_path / "n.json.gz", {"note": 2, "longer": True})
    assert NgramLM.shared(tmp_path / "n.json.gz").info == {"note": 2, "longer": True} and first.info == {"note": 1}
    with pytest.raises(FileNotFoundError, match="train_ngram.py"):
        NgramLM.load(tmp_path / "none.json.gz")
    with pytest.raises(ValueError, match="rescore=ngram needs decoder.ngram"):
        BPD(rescore="ngram")
    with pytest.raises(ValueError, match="no n-gram LM at"):
        BPD(rescore="ngram", ngram=str(tmp_path / "none.json.gz"))
    with pytest.raises(ValueError, match="rescore must be one of none, ngram, neural"):
        BPD(rescore="lm")
    with pytest.raises(ValueError, match="paths must be an integer >= 1"):
        BPD(paths=0)
    with pytest.raises(ValueError, match="block=5 needs as many heads"):
        BPD(block=5).load_addons(tiny_lm(seed=0))


def test_neural_scorer_matches_a_fresh_forward_and_restores_the_cache():
    lm = tiny_lm(seed=2)
    draft = SelfDraft(layers=1).build(lm)
    scorer = NeuralScorer(draft)
    sequence = [3, 1, 4, 1, 5]
    scorer.start(sequence)
    every = torch.arange(64)  # candidates: the whole vocabulary, so the scores are the log-probabilities
    first = scorer(torch.zeros(1, 0, dtype=torch.long), None, every)
    scorer(torch.tensor([[9], [2]]), torch.tensor([0, 0]), every)
    beams = [(2, 7), (9, 6), (2, 5)]  # their prefixes: rows 1, 0 and 1 of the level before
    deeper = scorer(torch.tensor(beams), torch.tensor([1, 0, 1]), every)
    scorer.finish()
    assert len(scorer.cache) == len(sequence)
    for beam, row in zip(beams, deeper):
        fresh = draft.forward(sequence + list(beam), draft.new_cache(), last_only=True)[-1]
        assert torch.allclose(row, torch.log_softmax(fresh, -1), atol=1e-4)
    fresh = draft.forward(sequence, draft.new_cache(), last_only=True)[-1]
    assert torch.allclose(first[0], torch.log_softmax(fresh, -1), atol=1e-4)


@pytest.mark.parametrize("width", [1, 3, 8])
def test_neural_rescoring_ranks_as_fresh_forwards_do(width):
    """The beam search with the neural scorer (one masked forward per position, on the draft's device)
    picks the paths a search scoring every path by a fresh forward of its own picks."""
    lm = tiny_lm(seed=3, layers=3)
    draft = SelfDraft(layers=2).build(lm)
    sequence = [7, 3, 9, 2]
    head_logp = torch.log_softmax(torch.randn(3, 64, generator=torch.Generator().manual_seed(width)), -1)

    def fresh(paths, parent, cand):
        rows = [draft.forward(sequence + path, draft.new_cache(), last_only=True)[-1] for path in paths.tolist()]
        return torch.log_softmax(torch.stack(rows).float(), -1)[:, cand]

    scorer = NeuralScorer(draft)
    scorer.start(sequence)
    got = lattice_beam_search(head_logp, 2, width, 0.8, scorer, on_host=False)
    scorer.finish()
    assert got == lattice_beam_search(head_logp, 2, width, 0.8, fresh) and len(got) == width
    assert len(scorer.cache) == len(sequence)


# ---- sampling: deterministic-candidate acceptance preserves the target distribution ---------
@pytest.mark.slow
@pytest.mark.parametrize("make,kwargs,wrong", [
    (lambda: Medusa(num_heads=2, choices=[[0], [1], [2], [0, 0]]), dict(temperature=0.8), dict(temperature=1.0)),
    (lambda: BPD(num_heads=2, paths=3, ranks_per_head=3), dict(temperature=1.0, top_p=0.9), dict(temperature=1.0)),
], ids=["medusa-t0.8", "bpd-p3-t1.0-topp0.9"])
def test_sampling_matches_exact_distribution(stat_model, make, kwargs, wrong):  # noqa: F811
    """Untrained heads on a peaked model: their candidates are often accepted, so the
    deterministic-candidate acceptance path is exercised."""
    lm, prompt = stat_model
    decoder = make()
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), kwargs, N_SAMPLES)
    assert hit_share >= 0.1, f"candidates accepted in only {hit_share:.0%} of steps: the test proves little"
    joint = exact_joint(lm, prompt, Sampling(**kwargs))
    assert counts[joint == 0].sum() == 0
    assert chi2_pvalue(counts, joint) > ALPHA
    assert chi2_pvalue(counts, exact_joint(lm, prompt, Sampling(**wrong))) < ALPHA


@pytest.mark.slow
def test_negative_control_typical_acceptance_is_not_the_target_distribution(stat_model):  # noqa: F811
    lm, prompt = stat_model
    decoder = Medusa(num_heads=2, choices=[[0], [1], [2], [0, 0]], accept_rule="typical", posterior_threshold=0.3,
                     posterior_alpha=0.5)
    kwargs = dict(temperature=1.0)
    counts, _ = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), kwargs, N_SAMPLES)
    assert chi2_pvalue(counts, exact_joint(lm, prompt, Sampling(**kwargs))) < ALPHA
