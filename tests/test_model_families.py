"""Every decoder on the model families researchers decode: Llama, Qwen3 (QK-norm), Qwen3-MoE and Mixtral
(mixtures of experts), Mistral (a sliding window on every layer), Gemma 2 (hybrid sliding / full layers,
soft-capped attention and logits), Gemma 3 (hybrid, QK-norm, tied embeddings, a rotary table per layer
type) and GPT-OSS (hybrid, experts, attention sinks): tiny random models built here (bench.models
tiny_config), each decoding past its window (8 positions: a 20-token prompt and 64 new tokens).

- the harness's autoregressive decoding equals transformers' own (generate(), with its own sliding-window
  caches and masks), on the native path; a negative control shows that masks without the window (what a
  cache-only fix would decode with) are caught;
- every method (conf/decoder/*.yaml, their variants on one hybrid family) equals autoregressive greedy on
  the fast path the suite runs, batch 1 and batch > 1; the fast path's forward equals the native one;
- sampling: every target distribution a sampling verifier reads equals the model's own next-token
  distribution for that node's prefix (transformers' full forward), so the exact-enumeration tests of
  the verifiers (test_exact_verification.py) hold on every family.
"""
from __future__ import annotations

import functools

import pytest
import torch

import decoders.core.loop as loop_module
from bench.models import TinyRandomModel
from decoders.core.batch import decode_batch
from decoders.core.hf_trace import hf_generate
from decoders.core.layer_types import AttentionPattern
from decoders.core.lm import LM
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode
from helpers import FAST_PATH, first_quick
from test_batch import BATCHED, mixed_prompts
from test_greedy_equality import DECODERS, METHODS, check_trace

GREEDY = Sampling()
WINDOW, NEW = 8, 64
# family -> the attention its transformers class runs (Gemma 2 and GPT-OSS have no sdpa path)
FAMILIES = {"llama": "sdpa", "qwen3": "sdpa", "qwen3_moe": "sdpa", "mixtral": "sdpa", "mistral": "sdpa",
            "gemma2": "eager", "gemma3": "sdpa", "gpt_oss": "eager"}
SLIDING = ["mistral", "mixtral", "gemma2", "gemma3", "gpt_oss"]
# The families of the quick run: one window on every layer (one mask), and hybrid layers (a mask per type).
QUICK = ["mistral", "gemma3"]


def family_params(families=FAMILIES):
    return [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in families]


@functools.cache
def family_lm(family: str, fast_path: str = FAST_PATH) -> LM:
    spec = TinyRandomModel(family=family, attn_implementation=FAMILIES[family],
                           sliding_window=WINDOW if family in SLIDING else None)
    return LM(spec.build(64), name=f"tiny-{family}", fast_path=fast_path)


def prompt(seed: int = 1) -> list[int]:
    """20 tokens with repeats (prompt lookup and n-gram drafts hit)."""
    g = torch.Generator().manual_seed(seed)
    unit = torch.randint(0, 64, (5,), generator=g).tolist()
    return unit * 3 + torch.randint(0, 64, (5,), generator=g).tolist()


def without_windows(monkeypatch) -> None:
    """The negative control: every layer's mask without its window (the whole history a full-history
    cache holds), as a fix of the cache alone would decode."""
    def unwindowed(self, allowed, query_positions, key_positions):
        return {kind: allowed for kind in self.by_type()} if self.mixed else allowed
    monkeypatch.setattr(AttentionPattern, "masks", unwindowed)


def test_tiny_families_have_the_attention_they_stand_for():
    """The matrix tests what it says: hybrid families mix sliding and full layers, window 8, and the
    prompt plus the output pass the window many times over."""
    for family in FAMILIES:
        pattern = family_lm(family, "none").pattern
        assert pattern.sliding == (family in SLIDING), family
        assert set(pattern.windows) <= {None, WINDOW}
        assert pattern.mixed == (family in ("gemma2", "gemma3", "gpt_oss")), family
    assert len(prompt()) + NEW > 8 * WINDOW


@pytest.mark.parametrize("family", family_params())
def test_autoregressive_equals_transformers_own_decoding(family):
    """The reference every decoder is held to: the harness's cache (every layer keeps its whole history)
    and masks give what transformers' own generate() gives with its sliding-window caches."""
    lm = family_lm(family, "none")
    ours = autoregressive_decode(lm, prompt(), NEW, GREEDY, stop_ids=set())
    theirs = hf_generate(lm, prompt(), NEW, GREEDY, stop_ids=set())
    assert ours.tokens == theirs.tokens


@pytest.mark.parametrize("family", family_params(SLIDING))
def test_masks_without_the_window_are_caught(family, monkeypatch):
    """Negative control: decoding with every layer seeing the whole history departs from transformers'
    own decoding on every sliding family, so the test above would catch an unwindowed mask."""
    lm = family_lm(family, "none")
    theirs = hf_generate(lm, prompt(), NEW, GREEDY, stop_ids=set()).tokens
    without_windows(monkeypatch)
    assert autoregressive_decode(lm, prompt(), NEW, GREEDY, stop_ids=set()).tokens != theirs


@pytest.mark.parametrize("path", ["kernel", "prepacked"])
@pytest.mark.parametrize("family", family_params())
def test_fast_path_forward_equals_native(family, path):
    """Each fast path computes the family's own formulas (our kernel's norms, rotary and attention are
    swapped only where a probe shows them bitwise the model's; oneDNN's packed linears): the logits of a
    prompt past the window and of a tree fed after it match the native path's."""
    native, fast = family_lm(family, "none"), family_lm(family, path)
    if fast.fast_path != path:
        pytest.skip(f"{path} does not run here: {fast.fast_path_note}")
    ids = prompt() * 2
    caches = [native.new_cache(), fast.new_cache()]
    outs = [lm.forward(ids, c) for lm, c in zip((native, fast), caches)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    n = len(ids)
    mask = torch.ones(4, n + 4, dtype=torch.bool)
    mask[:, n:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([n, n + 1, n + 1, n + 2])
    outs = [lm.forward([5, 6, 7, 8], c, position_ids=pos, mask=mask) for lm, c in zip((native, fast), caches)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)


# Each method's YAML defaults on every family; on the hybrid family of the quick run, the variants whose
# trees or windows reach deeper than the window (a node's ancestors cross it).
DEFAULT_CASES = [pytest.param(f, m, marks=[pytest.mark.slow] if f not in QUICK else []) for f in FAMILIES
                 for m in METHODS]
DEEP = ["eagle-dynamic-40-8-3-seed3", "dflash-tree-10-40-4-seed3", "recycling-40-10-3", "lookahead-7-3-unbounded",
        "jacobi-16-vocab", "spec_chain-9", "sequoia-24-8", "suffix-a4-d6-p0", "oracle-1-chain-7", "bpd-neural-p3"]
VARIANT_CASES = [pytest.param("gemma3", label, marks=pytest.mark.slow) for label in DEEP]


# The other fast path (the suite's runs on FAST_PATH) for methods of each kind of forward, on the hybrid family.
OTHER_PATH = "prepacked" if FAST_PATH != "prepacked" else "kernel"
PATH_CASES = [pytest.param("gemma3", m, OTHER_PATH, marks=pytest.mark.slow)
              for m in ["lookahead", "eagle", "recycling", "medusa", "sequoia"]]


@pytest.mark.parametrize("family,decoder,path", [pytest.param(*p.values, FAST_PATH, marks=p.marks)
                                                 for p in DEFAULT_CASES + VARIANT_CASES] + PATH_CASES)
def test_every_decoder_equals_autoregressive(family, decoder, path):
    lm = family_lm(family, path)
    reference = autoregressive_decode(lm, prompt(), NEW, GREEDY, stop_ids=set())
    out = DECODERS[decoder].generate(lm, prompt(), NEW, GREEDY, set())
    assert out.tokens == reference.tokens
    check_trace(out, NEW, set())


BATCH_CASES = [pytest.param(f, name, marks=[] if f in QUICK else [pytest.mark.slow]) for f in FAMILIES
               for name in ["lookahead-5-4-5", "eagle-dynamic-10-3-4-seed1", "dflash-tree-6-8-3-seed2", "specinfer-2x3"]
               + (["medusa-auto-16", "prompt_lookup-10-2", "recycling-cold-16-4-4"] if f in QUICK else [])]


@pytest.mark.parametrize("family,name", BATCH_CASES)
def test_batched_rows_equal_batch_1(family, name):
    """Batch rows hold different lengths: each row's window is over its own positions, not the slots."""
    decoder, lm = BATCHED[name], family_lm(family)
    prompts = [p + prompt(i) for i, p in enumerate(mixed_prompts(3, 3))]
    gens, _ = decode_batch(decoder, lm, prompts, 40, [GREEDY] * 3, set())
    assert [g.tokens for g in gens] == [decoder.generate(lm, p, 40, GREEDY, set()).tokens for p in prompts]


# The methods whose sampling is exact verification (Medusa's typical acceptance is lossy by design).
# (a drawn draft's chain, a drawn tree of EAGLE's, deterministic trees and a side branch, a block draft's
# chain drawn position by position)
SAMPLED = ["spec_chain", "eagle", "recycling", "lookahead", "dflash-chain-4-seed1"]


def sampled_rows_error(lm: LM, decoder: str, monkeypatch) -> float:
    """Decode with sampling, recording every tree and the target distributions verification reads; the
    largest difference between a node's row and the model's own next-token distribution for its prefix
    (the whole sequence through transformers' forward, no cache), over the steps past the window."""
    seen, real_verify, real_commit = [], loop_module.verify, loop_module.verify_and_commit
    committed: list[int] = []

    def verify_and_commit(d, *args, **kwargs):
        committed[:] = d.sequence  # before this step's tokens
        return real_commit(d, *args, **kwargs)

    def verify(proposal, scores, sampler):
        seen.append((list(committed), proposal.tree, sampler.probs(scores.logits), sampler))
        return real_verify(proposal, scores, sampler)

    monkeypatch.setattr(loop_module, "verify_and_commit", verify_and_commit)
    monkeypatch.setattr(loop_module, "verify", verify)
    DECODERS[decoder].generate(lm, prompt(), 40, Sampling(temperature=0.8, top_k=20), set())
    worst, checked = 0.0, 0
    for context, tree, probs, sampler in seen:
        if len(context) <= len(prompt()) + WINDOW:
            continue
        for node in range(len(tree)):
            path = [tree.tokens[i] for i in tree.path(node)[1:]]
            with torch.inference_mode():
                logits = lm.model(input_ids=torch.tensor([context + path])).logits[0, -1:]
            worst = max(worst, float((sampler.probs(logits)[0] - probs[node]).abs().max()))
            checked += 1
    assert checked > 10
    return worst


@pytest.mark.parametrize("family", family_params(SLIDING))
@pytest.mark.parametrize("decoder", first_quick(SAMPLED))
def test_sampling_verifies_against_the_models_own_distributions(family, decoder, monkeypatch):
    assert sampled_rows_error(family_lm(family), decoder, monkeypatch) < 1e-4


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("initialised", [True, False])
@pytest.mark.parametrize("kind", ["block", "eagle"])
def test_a_drafts_layer_sets_what_its_constructor_leaves_unset(family, initialised, kind, monkeypatch):
    """Experts, routers and gpt-oss's sinks are torch.empty in a decoder layer's constructor: a block
    draft's layer and an EAGLE draft's initialise them (a random draft's logits are finite, and one seed is
    one draft). Memory as torch.empty left it is stood for by NaN; without the initialisation
    (initialised=False, the negative control) it stays."""
    import decoders.methods.block_draft as block_draft
    import decoders.methods.eagle_draft as eagle_draft

    lm = family_lm(family)
    module = block_draft if kind == "block" else eagle_draft
    if not initialised:
        monkeypatch.setattr(module, "init_unset_parameters", lambda lm, layers: None)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    drafts = [block_draft.new_block_draft(lm, seed=1) if kind == "block" else eagle_draft.new_draft(lm, seed=1)
              for _ in range(2)]
    monkeypatch.setattr(torch, "empty", empty)
    layers = [d.layers if kind == "block" else d.layer for d in drafts]
    finite = all(bool(p.isfinite().all()) for p in layers[0].parameters())
    assert finite == initialised
    assert all(torch.equal(a, b) for a, b in zip(layers[0].parameters(), layers[1].parameters())) == initialised
    if initialised and kind == "block":
        draft = drafts[0]
        with torch.inference_mode():
            _, feats = lm.forward(prompt(), lm.new_cache(), features=draft.reads)
            out = draft(feats[:-1], prompt()[-1], block_draft.KVCache(block_draft.DynamicCache()), 4)
        assert bool(draft.logits(out).isfinite().all())


@pytest.mark.parametrize("family", family_params(SLIDING))
def test_sampling_check_catches_masks_without_the_window(family, monkeypatch):
    without_windows(monkeypatch)
    assert sampled_rows_error(family_lm(family), "spec_chain", monkeypatch) > 1e-3


# ---- accounting per layer type -------------------------------------------------------------------
@pytest.mark.parametrize("tokens,context", [(1, 0), (1, 3), (5, 0), (5, 4), (3, 20), (12, 2), (30, 30)])
def test_flops_count_each_sliding_layers_pairs_up_to_its_window(tokens, context):
    """forward_flops' attention term counts, for each layer, the (query, key) pairs a causal feed computes:
    new token i sees min(context + i + 1, window) keys on a sliding layer (counted here one by one)."""
    from decoders.core.lm import attended_pairs, forward_flops

    def pairs(window):
        return sum(min(context + i + 1, window or 10**9) for i in range(tokens))

    for window in (None, 1, 4, 8, 25):
        assert attended_pairs(tokens, context, window) == pairs(window)
    spec = {"matmul_params": 0, "n_layers": 5, "d_attn": 2, "sliding": [[4, 2], [8, 1]]}
    assert forward_flops(spec, tokens, context) == 4.0 * 2 * (2 * pairs(None) + 2 * pairs(4) + pairs(8))


def test_flops_spec_of_a_hybrid_model_names_its_windows():
    lm = family_lm("gemma3", "none")
    spec = lm.flops_spec()
    assert spec["sliding"] == [[WINDOW, 1]] and spec["n_layers"] == 2
    assert "1 sliding layers over their 8-token window" in lm.flops_counted()
    assert "sliding" not in family_lm("llama", "none").flops_spec()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_flops_of_a_mixture_of_experts_count_the_experts_a_token_is_routed_to(family):
    """2 of 4 experts a token: half of the experts' parameters do matmul work per token, everything else
    (attention, router, norms, the head) all of it."""
    lm = family_lm(family, "none")
    params = dict(lm.model.named_parameters())
    experts = sum(p.numel() for name, p in params.items() if ".experts." in name)
    rest = sum(p.numel() for name, p in params.items() if ".experts." not in name and "embed_tokens" not in name)
    head = lm.model.get_output_embeddings().weight
    rest += head.numel() if "lm_head.weight" not in params else 0  # a tied head is a matmul too
    assert lm.flops_spec()["matmul_params"] == rest + experts // 2
    assert "the 2 of 4 a token is routed to" in lm.flops_counted()


# ---- unsupported is one line ----------------------------------------------------------------------
def _config_dir(tmp_path, model_type: str, **kwargs):
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING[model_type](num_hidden_layers=4, **kwargs).save_pretrained(tmp_path / model_type)
    return tmp_path / model_type


@pytest.mark.parametrize("model_type,kind", [("llama4_text", "chunked_attention"), ("qwen3_next", "linear_attention"),
                                             ("falcon_h1", "hybrid")])
def test_a_model_whose_layers_the_harness_cannot_mask_is_refused_from_its_config(tmp_path, model_type, kind):
    """Before any weight is read: the model type, the layers it has, and what is supported."""
    from bench.errors import BenchError
    from bench.models import PretrainedModel

    spec = PretrainedModel(name="m", path=str(_config_dir(tmp_path, model_type)), device="cpu")
    with pytest.raises(BenchError, match=f"model m: model type '{model_type}' has {kind} layers; the harness "
                                         "decodes models whose layers are full_attention or sliding_attention"):
        spec.fit()


def test_a_model_class_without_sdpa_is_told_to_use_eager():
    from bench.errors import BenchError

    with pytest.raises(BenchError, match="Gemma2ForCausalLM has no sdpa attention .*model.attn_implementation=eager"):
        TinyRandomModel(family="gemma2", device="cpu", vocab_size=64).fit(tokenizer=type("T", (), {
            "__len__": lambda self: 64, "eos_token_id": None})())


@pytest.mark.slow
def test_the_cli_refuses_it_in_one_line_before_claiming_the_run_directory(tmp_path):
    from helpers import run_cli
    from test_faults import one_line_error

    path = _config_dir(tmp_path, "llama4_text", attention_chunk_size=8)
    out = run_cli("model=codellama-7b", f"model.path={path}", f"hydra.run.dir={tmp_path / 'run'}")
    one_line_error(out, "model type 'llama4_text' has chunked_attention layers")
    from bench.rundir import MARKER

    assert not (tmp_path / "run" / MARKER).exists() and not (tmp_path / "run" / "config.yaml").exists()


# ---- drafts borrow what the target has ----------------------------------------------------------
def test_drafts_and_heads_read_the_target_head_as_the_target_does():
    """Gemma 2 soft-caps its logits after the head (cap * tanh(logits / cap)): an EAGLE draft's and
    Medusa heads' readouts through the same head are capped the same way."""
    from decoders.methods.eagle_draft import FeatureDraft
    from decoders.methods.heads import new_heads

    lm = family_lm("gemma2", "none")
    cap = lm.logit_cap
    assert cap == 30.0
    with torch.inference_mode():
        logits, features = lm.forward(prompt(), lm.new_cache(), features=True)
        head = lm.model.get_output_embeddings()
        raw = head(lm.final_norm(features))
        torch.testing.assert_close(logits, torch.tanh(raw / cap) * cap)  # what the target itself does
        torch.testing.assert_close(FeatureDraft(lm).logits(features), logits)
        hidden = lm.final_norm(features)
        torch.testing.assert_close(new_heads(lm, 2)(hidden)[0], logits)  # untrained heads repeat the head's guess
        assert float(FeatureDraft(lm).logits(features * 100).abs().max()) <= cap


def test_an_eagle_draft_of_a_hybrid_target_attends_fully_with_the_global_rotary():
    """Gemma 3 keeps a rotary table per layer type (local base 10k for sliding layers, global 1M): the
    draft's layer is a full-attention layer of the target's class, and its forward reads the
    full-attention table (a forward with the local one differs)."""
    from decoders.core.kv_cache import causal_mask
    from decoders.methods.eagle_draft import FeatureDraft

    lm = family_lm("gemma3", "none")
    torch.manual_seed(0)
    draft = FeatureDraft(lm)
    with torch.no_grad():
        for p in draft.layer.parameters():
            p.normal_(0, 0.3)
    assert draft.layer.self_attn.sliding_window is None
    features, tokens = torch.randn(6, 64), torch.tensor([3, 9, 4, 1, 7, 2])
    positions, mask = torch.arange(200, 206), causal_mask(6, 0)
    with torch.inference_mode():
        out = draft(features, tokens, positions, mask)
        x = draft.fuse(torch.cat([features, lm.model.get_input_embeddings()(tokens)], -1))[None]

        def by(kind):
            rope = lm.model.base_model.rotary_emb(x, positions[None], kind)
            return draft.layer(x, attention_mask=lm.mask_4d(mask), position_ids=positions[None],
                               position_embeddings=rope)[0]
        torch.testing.assert_close(out, by("full_attention"))
        assert not torch.allclose(out, by("sliding_attention"), atol=1e-3)


# ---- a 262,144-token vocabulary ------------------------------------------------------------------
@pytest.mark.slow
def test_tables_at_a_262k_vocabulary_hold_what_was_seen():
    """Gemma 3's vocabulary: recycling's adjacency table, suffix decoding's global trie and lookahead's
    n-gram pool grow with the tokens a decode saw (rows scored, text committed), never with the
    vocabulary (a table of vocabulary x successors would be 262,144 rows before the first step)."""
    from decoders.methods.lookahead import Lookahead
    from decoders.methods.recycling import Recycling
    from decoders.methods.suffix import Suffix

    spec = TinyRandomModel(family="gemma3", sliding_window=WINDOW, vocab_size=262_144, hidden_size=32,
                           intermediate_size=64)
    lm = LM(spec.build(262_144), name="tiny-gemma3-262k", fast_path="none")
    ids = [7, 70_000, 262_143, 5, 7, 70_000, 262_143, 5, 131_072]
    recycling, suffix = Recycling(tree_size=16, depth=4), Suffix()
    for decoder in (recycling, suffix, Lookahead(window=4, ngram=3, guess_set_size=4)):
        out = decoder.generate(lm, ids, 32, GREEDY, set())
        assert out.tokens == autoregressive_decode(lm, ids, 32, GREEDY, stop_ids=set()).tokens
        scored = sum(s.forward_tokens for s in out.steps)
        if decoder is recycling:
            assert 0 < len(recycling.carried(lm)) <= scored  # a row per token scored, at most
        if decoder is suffix:
            assert 0 < len(suffix.global_trie(lm)) <= 1 + (len(ids) + 32) * suffix.max_depth
