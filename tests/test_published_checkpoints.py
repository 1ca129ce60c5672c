"""Published checkpoints load in their authors' layouts and compute what their authors' definitions
compute: EAGLE-1/2 (against the authors' own module, eagle-llm's `eagle.model.cnets.Model`),
EAGLE-3 and Medusa-1 (against references written here from the published module definitions).
Tiny checkpoints in each layout are written for tiny random Llama targets; greedy equality with
autoregressive and the exact sampling distribution are checked with each; a checkpoint made for
another target is refused in one line; a hub id goes through huggingface_hub.

Why EAGLE-3 has no import of the authors' module: eagle-llm's latest release (1.2.1) predates
EAGLE-3 and ships only the EAGLE-1 draft. Why Medusa has none: its `medusa_model.py` imports the
authors' patched Llama (modeling_llama_kv) at module level, which does not import under
transformers 5; the heads themselves are a few lines, rebuilt below from that file's definition.
"""
from __future__ import annotations

import json
import shutil
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from decoders.core.kv_cache import KVCache
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.eagle import Eagle
from decoders.methods.eagle_draft import load_draft
from decoders.methods.heads import load_heads
from decoders.methods.medusa import Medusa
from helpers import chi2_pvalue, tiny_lm
from test_lookahead import LENGTH, VOCAB, ALPHA, cycle_prompt, exact_joint, sample_counts
from transformers import DynamicCache

from decoders.methods.eagle1_layout import write_eagle1

GREEDY = Sampling()
N_PUBLISHED = 200  # samples per exact-distribution case
NAME = "tiny-llama"  # the base model name the checkpoints record


def target(layers: int = 2, vocab: int = 64, init_std: float = 0.2):
    lm = tiny_lm(seed=0, vocab=vocab, layers=layers, init_std=init_std)
    lm.name = NAME
    return lm


def close(a, b) -> bool:
    return float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-6


def perturbed(shape, gen, scale=0.3, base=0.0):
    return base + torch.randn(shape, generator=gen) * scale


# ---- checkpoints in the authors' layouts -----------------------------------------------------------
# EAGLE-1/2's is written by the authors' own module: decoders/methods/eagle1_layout.py (write_eagle1).
def write_eagle3(path, lm, seed: int, draft_vocab: int | None = None, embed: bool = False):
    """An EAGLE-3 draft in cnets.py's layout: fc (3d -> d), midlayer.*, norm, lm_head over a draft
    vocabulary with d2t (draft id -> target id offset) and t2d."""
    cfg, gen = lm.config, torch.Generator().manual_seed(seed)
    d, V, inter = cfg.hidden_size, lm.vocab_size, cfg.intermediate_size
    dv = draft_vocab or V
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = d // hq
    lin = lambda o, i: perturbed((o, i), gen, 1 / math.sqrt(i))  # noqa: E731
    ids = torch.randperm(V, generator=gen)[:dv].sort().values
    state = {"fc.weight": lin(d, 3 * d), "midlayer.self_attn.q_proj.weight": lin(hq * hd, 2 * d),
             "midlayer.self_attn.k_proj.weight": lin(hkv * hd, 2 * d),
             "midlayer.self_attn.v_proj.weight": lin(hkv * hd, 2 * d),
             "midlayer.self_attn.o_proj.weight": lin(d, hq * hd), "midlayer.mlp.gate_proj.weight": lin(inter, d),
             "midlayer.mlp.up_proj.weight": lin(inter, d), "midlayer.mlp.down_proj.weight": lin(d, inter),
             "midlayer.hidden_norm.weight": perturbed(d, gen, 0.1, 1.0),
             "midlayer.input_layernorm.weight": perturbed(d, gen, 0.1, 1.0),
             "midlayer.post_attention_layernorm.weight": perturbed(d, gen, 0.1, 1.0),
             "norm.weight": perturbed(d, gen, 0.1, 1.0), "lm_head.weight": lin(dv, d),
             "d2t": ids - torch.arange(dv), "t2d": torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)}
    if embed:
        state["embed_tokens.weight"] = lm.model.get_input_embeddings().weight.detach().clone()
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": d, "intermediate_size": inter,
        "num_attention_heads": hq, "num_key_value_heads": hkv, "num_hidden_layers": 1, "vocab_size": V,
        "draft_vocab_size": dv, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu", "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "base_model_name_or_path": f"someone/{NAME}"}))
    return state


def write_medusa(path, lm, *, seed: int, heads: int = 3, layers: int = 1, own_outputs: bool = True,
                 fmt: str = "safetensors", base: str = NAME):
    """medusa_lm_head.* in medusa_model.py's layout: head i = Sequential(ResBlock x layers, Linear(d, V))."""
    d, V, gen = lm.config.hidden_size, lm.vocab_size, torch.Generator().manual_seed(seed)
    state = {}
    for i in range(heads):
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"] = perturbed((d, d), gen, 0.3)
            state[f"{i}.{j}.linear.bias"] = perturbed(d, gen, 0.3)
        if own_outputs:
            state[f"{i}.{layers}.weight"] = perturbed((V, d), gen, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_file(state, str(path / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, path / "medusa_lm_head.pt")
    # the config names fewer heads than the file holds, as some published ones do
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": layers,
                                                  "base_model_name_or_path": base}))
    return state


# ---- references from the published definitions -------------------------------------------------
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta=10000.0):
    """x (heads, rows, hd): the rotate-half RoPE of the authors' LlamaRotaryEmbedding."""
    hd = x.shape[-1]
    freqs = positions.double()[:, None] / theta ** (torch.arange(0, hd, 2).double() / hd)[None]
    emb = torch.cat([freqs, freqs], -1)
    rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * emb.cos().float() + rotated * emb.sin().float()


def eagle3_reference(state, lm, hidden, tokens):
    """cnets.py's Model.forward + its lm_head(norm(.)), causal over all rows, from scratch: `hidden`
    (rows, d) are the layer's input features (fc already applied to target rows), tokens (rows,)."""
    cfg = lm.config
    eps, hq, hkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    n, d = hidden.shape
    hd = d // hq
    s = {k: v.float() for k, v in state.items()}
    emb = lm.model.get_input_embeddings().weight[torch.as_tensor(tokens)]
    x = torch.cat([rms(emb, s["midlayer.input_layernorm.weight"], eps),
                   rms(hidden, s["midlayer.hidden_norm.weight"], eps)], -1)
    pos = torch.arange(n)
    q = rope((x @ s["midlayer.self_attn.q_proj.weight"].T).view(n, hq, hd).transpose(0, 1), pos)
    k = rope((x @ s["midlayer.self_attn.k_proj.weight"].T).view(n, hkv, hd).transpose(0, 1), pos)
    v = (x @ s["midlayer.self_attn.v_proj.weight"].T).view(n, hkv, hd).transpose(0, 1)
    k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd) + torch.full((n, n), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, hq * hd) @ s["midlayer.self_attn.o_proj.weight"].T
    h = hidden + attn
    u = rms(h, s["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = u @ s["midlayer.mlp.gate_proj.weight"].T, u @ s["midlayer.mlp.up_proj.weight"].T
    h = h + (F.silu(gate) * up) @ s["midlayer.mlp.down_proj.weight"].T
    return h, rms(h, s["norm.weight"], eps) @ s["lm_head.weight"].T


def medusa_reference(state, lm, hidden, heads, layers, own_outputs):
    out = []
    for i in range(heads):
        x = hidden
        for j in range(layers):
            x = x + F.silu(x @ state[f"{i}.{j}.linear.weight"].T + state[f"{i}.{j}.linear.bias"])
        out.append(x @ (state[f"{i}.{layers}.weight"] if own_outputs else lm.model.get_output_embeddings().weight).T)
    return torch.stack(out)


def run_draft(draft, feats, tokens, then):
    """Our draft over the committed rows (the proposer's first feed), then one drafted node reading
    the last row's output with token `then`: (outputs of both feeds, the second's)."""
    cache = KVCache(DynamicCache())
    n = len(tokens)
    with torch.inference_mode():
        first = draft(draft.from_target(feats), torch.tensor(tokens), torch.arange(n),
                      torch.ones(n, n, dtype=torch.bool).tril(), cache)
        second = draft(first[-1:], torch.tensor([then]), torch.tensor([n]), torch.ones(1, n + 1, dtype=torch.bool),
                       cache)
    return first, second


SEQ = [5, 17, 3, 3, 40, 22, 9, 61, 12, 0, 33]


@pytest.mark.parametrize("fmt,embed", [("bin", True), ("safetensors", False)])
@torch.inference_mode()
def test_eagle1_draft_equals_the_authors_module(tmp_path, fmt, embed):
    lm = target()
    ref = write_eagle1(tmp_path / "e1", lm, seed=1, fmt=fmt, embed=embed)
    draft = load_draft(lm, tmp_path / "e1")
    n = len(SEQ) - 1
    _, feats = lm.forward(SEQ[:n], lm.new_cache(), features=True)  # the final norm's input
    _, normed = lm.forward(SEQ[:n], lm.new_cache(), hidden=True)  # what ea_model.py hands the draft
    ours, ours2 = run_draft(draft, feats, SEQ[1:], then=7)
    with torch.no_grad():
        theirs, kv = ref(normed[None], input_ids=torch.tensor([SEQ[1:]]), use_cache=True)
        theirs2, _ = ref(theirs[:, -1:], input_ids=torch.tensor([[7]]), past_key_values=kv, use_cache=True)
    head = lm.model.get_output_embeddings()
    for a, b in [(ours, theirs[0]), (ours2, theirs2[0])]:
        assert close(a, b)  # the predicted features
        assert close(draft.logits(a), head(b))  # read by the target's head, no norm between
    assert draft.reads is True and len(draft.vocab) == lm.vocab_size


@pytest.mark.parametrize("draft_vocab,embed", [(48, False), (None, True)])
@torch.inference_mode()
def test_eagle3_draft_equals_the_published_definition(tmp_path, draft_vocab, embed):
    lm = target(layers=8)
    state = write_eagle3(tmp_path / "e3", lm, seed=2, draft_vocab=draft_vocab, embed=embed)
    draft = load_draft(lm, tmp_path / "e3")
    n = len(SEQ) - 1
    _, fused = lm.forward(SEQ[:n], lm.new_cache(), features=draft.reads)
    with torch.no_grad():  # low / mid / high: the inputs of layers 2, L // 2 and L - 3, as ea_model.py takes them
        hs = lm.model(input_ids=torch.tensor([SEQ[:n]]), output_hidden_states=True).hidden_states
    assert draft.reads == (2, 4, 5) and close(fused, torch.cat([hs[2][0], hs[4][0], hs[5][0]], -1))
    ours, ours2 = run_draft(draft, fused, SEQ[1:], then=7)
    fc = fused @ state["fc.weight"].T
    theirs, logits = eagle3_reference(state, lm, fc, SEQ[1:])
    assert close(ours, theirs) and close(draft.logits(ours), logits)
    # depth 2: the drafted node feeds back the layer's own output, without fc
    theirs2, logits2 = eagle3_reference(state, lm, torch.cat([fc, theirs[-1:]]), SEQ[1:] + [7])
    assert close(ours2[0], theirs2[-1]) and close(draft.logits(ours2)[0], logits2[-1])
    assert torch.equal(draft.vocab, torch.arange(len(state["d2t"])) + state["d2t"])  # draft id -> target id
    assert draft.vocab.tolist() == state["t2d"].nonzero().flatten().tolist()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["eagle1", "eagle3"])
@torch.inference_mode()
def test_published_drafts_round_float32_rotary_tables_once(tmp_path, layout, dtype):
    """A published draft cast to half precision keeps float32 rotary frequencies, so its cos
    and sin are the float32 tables rounded once, at positions up to 4096 (with a cast inv_freq they
    were off by up to 0.24 at 1000 and 0.95 at 4000); for EAGLE-1 they equal the authors' module's own
    tables (built in float32, cast with the module) wherever it caches them, below 2048; and the
    draft's half-precision output at positions near 4000 stays within the dtype's reach of its
    float32 output."""
    half = getattr(torch, dtype)
    layers = 8 if layout == "eagle3" else 2
    lm32, lm = (tiny_lm(seed=0, vocab=64, layers=layers, dtype=d) for d in ("float32", dtype))
    lm32.name = lm.name = NAME
    ref = (write_eagle3 if layout == "eagle3" else write_eagle1)(tmp_path / layout, lm32, seed=3)
    draft32, draft = load_draft(lm32, tmp_path / layout), load_draft(lm, tmp_path / layout)
    assert draft.dtype == half and draft.rotary.inv_freq.dtype == torch.float32
    positions = torch.arange(4096)[None]
    cos, sin = draft.rotary(torch.zeros(1, dtype=half), positions)
    exact = positions[..., None].double() * draft32.rotary.inv_freq.double()
    exact = torch.cat([exact, exact], -1)
    ulp = torch.finfo(half).eps  # relative spacing at 1: |cos| <= 1, so half a spacing + float32's own error
    assert (cos.double() - exact.cos()).abs().max() <= ulp / 2 + 1e-3 * ulp + 4096 * 2e-7
    assert (sin.double() - exact.sin()).abs().max() <= ulp / 2 + 1e-3 * ulp + 4096 * 2e-7
    if layout == "eagle1":
        authors = ref.to(half).layers[0].self_attn.rotary_emb
        their_cos = authors.cos_cached[0, 0]  # (2048, head_dim)
        assert their_cos.dtype == half and (cos[0, :2048].float() - their_cos.float()).abs().max() <= ulp
    # the draft over rows at positions 4000..: half precision against float32, same weights
    n = len(SEQ) - 1
    _, feats = lm32.forward(SEQ[:n], lm32.new_cache(), features=draft32.reads)
    far, mask = torch.arange(4000, 4000 + n), torch.ones(n, n, dtype=torch.bool).tril()
    out32 = draft32(draft32.from_target(feats), torch.tensor(SEQ[1:]), far, mask, KVCache(DynamicCache()))
    out = draft(draft.from_target(feats.to(half)), torch.tensor(SEQ[1:]), far, mask, KVCache(DynamicCache()))
    logits32, logits = draft32.logits(out32), draft.logits(out).float()
    assert float((logits - logits32).norm()) <= 30 * ulp * float(logits32.norm())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_our_draft_keeps_float32_rotary_frequencies(dtype):
    """Our own EAGLE draft (decoders/methods/eagle_draft.py) holds its rotary module outside its
    submodules, so a cast to half precision leaves the frequencies float32 (as the published ones)."""
    from decoders.methods.eagle_draft import new_draft

    draft = new_draft(tiny_lm(seed=0, vocab=64, layers=2, dtype=dtype), None)
    rotary = draft.target.rotary
    assert rotary.inv_freq.dtype == torch.float32
    cos, _ = rotary(torch.zeros(1, dtype=getattr(torch, dtype)), torch.arange(4000, 4096)[None])
    exact = torch.arange(4000, 4096)[:, None].double() * rotary.inv_freq.double()
    assert (cos[0].double() - torch.cat([exact, exact], -1).cos()).abs().max() <= torch.finfo(cos.dtype).eps


@pytest.mark.parametrize("layers,own_outputs,fmt", [(1, True, "safetensors"), (2, True, "pt"), (1, False, "pt")])
@torch.inference_mode()
def test_medusa1_heads_equal_the_published_definition(tmp_path, layers, own_outputs, fmt):
    lm = target()
    state = write_medusa(tmp_path / "m", lm, seed=3, heads=3, layers=layers, own_outputs=own_outputs, fmt=fmt)
    heads = load_heads(lm, tmp_path / "m")
    _, hidden = lm.forward(SEQ, lm.new_cache(), hidden=True)  # the last hidden state, as medusa_model.py reads it
    with torch.inference_mode():
        ours = heads(hidden)
    assert heads.k == 3  # from the tensors, not config.json's medusa_num_heads
    assert close(ours, medusa_reference(state, lm, hidden, 3, layers, own_outputs))


# ---- greedy equality and the exact distribution with each layout ----------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    small, deep = target(), target(layers=8)
    write_eagle1(root / "eagle1-bin", small, seed=4, fmt="bin")
    write_eagle1(root / "eagle1-st", small, seed=5, fmt="safetensors", embed=False)
    write_eagle3(root / "eagle3", deep, seed=6, draft_vocab=40)
    write_medusa(root / "medusa1", small, seed=7, heads=3, layers=2)
    write_medusa(root / "medusa1-legacy", small, seed=8, heads=3, own_outputs=False, fmt="pt")
    write_medusa(root / "medusa1-4", small, seed=9, heads=4)  # deep enough for Medusa-1's mc_sim_7b_63
    return root, small, deep


DECODERS = {  # name -> (checkpoint, target, decoder)
    "eagle1-dynamic-bin": ("eagle1-bin", "small", lambda p: Eagle(draft_weights=p, tree_size=10, depth=4, top_k=3)),
    "eagle1-static-st": ("eagle1-st", "small",
                         lambda p: Eagle(draft_weights=p, tree="static", tree_size=8, depth=3, top_k=3)),
    "eagle3-dynamic": ("eagle3", "deep", lambda p: Eagle(draft_weights=p, tree_size=12, depth=4, top_k=4)),
    "eagle3-static": ("eagle3", "deep", lambda p: Eagle(draft_weights=p, tree="static", tree_size=6, depth=3, top_k=2)),
    "eagle1-dynamic-bf16-draft": ("eagle1-st", "small", lambda p: Eagle(draft_weights=p, tree_size=10, depth=4,
                                                                        top_k=3, draft_dtype="bfloat16")),
    "eagle3-dynamic-bf16-draft": ("eagle3", "deep", lambda p: Eagle(draft_weights=p, tree_size=12, depth=4, top_k=4,
                                                                    draft_dtype="bfloat16")),
    "medusa1-auto": ("medusa1", "small", lambda p: Medusa(heads=p, tree_size=12)),
    # two blocks per head, and the tree's size chosen from the heads' measured cost (it read blocks[0].linear)
    "medusa1-auto-size": ("medusa1", "small", lambda p: Medusa(heads=p, tree_size="auto", auto_sizes=[2, 4, 8])),
    # the authors' own trees, by name (decoders/published_trees.json)
    "eagle1-mc_sim_7b_63": ("eagle1-bin", "small", lambda p: Eagle(draft_weights=p, tree="mc_sim_7b_63")),
    "medusa1-mc_sim_7b_63": ("medusa1-4", "small", lambda p: Medusa(heads=p, choices="mc_sim_7b_63")),
    "medusa1-legacy-list": ("medusa1-legacy", "small",
                            lambda p: Medusa(heads=p, choices=[[0], [1], [0, 0], [0, 0, 0]])),
}


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("seed", range(2))
def test_greedy_equality_with_published_checkpoints(checkpoints, name, seed):
    root, small, deep = checkpoints
    ckpt, which, make = DECODERS[name]
    lm = small if which == "small" else deep
    prompt = torch.randint(0, 64, (3 + 7 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    reference = autoregressive_decode(lm, prompt, 16, GREEDY, stop_ids=set())
    out = make(str(root / ckpt)).generate(lm, prompt, 16, GREEDY, set())
    assert out.tokens == reference.tokens
    assert sum(s.draft_tokens for s in out.steps) > 0


def test_batched_rows_with_eagle3_equal_batch_1(checkpoints):
    """gen.batch_size > 1: the batched forward hands each row the fused low / mid / high features."""
    from decoders.core.batch import decode_batch

    root, _, deep = checkpoints
    decoder = DECODERS["eagle3-dynamic"][2](str(root / "eagle3"))
    prompts = [[1, 2, 3], list(range(5, 30)), [7] * 9]
    alone = [decoder.generate(deep, p, 10, GREEDY, set()).tokens for p in prompts]
    gens, _ = decode_batch(decoder, deep, prompts, 10, [GREEDY] * 3, set())
    assert [g.tokens for g in gens] == alone


def stat_target(layers: int):
    """test_lookahead's stat_model, with `layers` layers (EAGLE-3 needs 7 or more)."""
    lm = target(layers=layers, vocab=VOCAB, init_std=0.4)
    return lm, cycle_prompt(lm)


SAMPLING_CASES = {  # every token is a depth-1 candidate (top_k / ranks = VOCAB), so candidates are tried every step
    "eagle1-t0.8": ("eagle1", 2, lambda p: Eagle(draft_weights=p, tree_size=8, depth=1, top_k=VOCAB),
                    dict(temperature=0.8)),
    "eagle3-t1.0-topp0.9": ("eagle3", 7, lambda p: Eagle(draft_weights=p, tree_size=8, depth=1, top_k=VOCAB),
                            dict(temperature=1.0, top_p=0.9)),
    "medusa1-t0.8": ("medusa1", 2, lambda p: Medusa(heads=p, choices=[[r] for r in range(VOCAB)] + [[0, 0]]),
                     dict(temperature=0.8)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_sampling_matches_exact_distribution(tmp_path, case):
    layout, layers, make, kwargs = SAMPLING_CASES[case]
    lm, prompt = stat_target(layers)
    {"eagle1": write_eagle1, "eagle3": write_eagle3, "medusa1": write_medusa}[layout](tmp_path / layout, lm, seed=9)
    decoder = make(str(tmp_path / layout))
    # N_PUBLISHED samples, not N_SAMPLES: each layout has its own case (the suite's time budget), and
    # these already reject the negative control (temperature 0.5 for 0.8 / 1.0) below
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), kwargs, N_PUBLISHED)
    assert hit_share >= 0.2, f"drafts accepted in only {hit_share:.0%} of steps: the test proves little"
    joint = exact_joint(lm, prompt, Sampling(**kwargs))
    assert counts[joint == 0].sum() == 0
    assert chi2_pvalue(counts, joint) > ALPHA
    assert chi2_pvalue(counts, exact_joint(lm, prompt, Sampling(temperature=0.5))) < ALPHA  # negative control


# ---- checks against the target, and where checkpoints come from -----------------------------------
def test_a_checkpoint_for_another_target_is_refused_in_one_line(tmp_path):
    lm = target()
    write_medusa(tmp_path / "vicuna", lm, seed=0, base="lmsys/vicuna-7b-v1.3")
    write_medusa(tmp_path / "wide", target(vocab=80), seed=0)
    write_eagle1(tmp_path / "e1", target(), seed=0, base_model_name_or_path="other/model")
    cases = [(lambda: load_heads(lm, tmp_path / "vicuna"),
              "made for base model lmsys/vicuna-7b-v1.3; the target is tiny-llama"),
             (lambda: load_heads(lm, tmp_path / "wide"), "vocabulary of 80 tokens; tiny-llama has 64"),
             (lambda: load_draft(tiny_lm(seed=0, hidden=32), tmp_path / "e1"), "hidden size 64; model has 32"),
             (lambda: load_draft(lm, tmp_path / "e1"), "made for base model other/model"),
             (lambda: load_draft(lm, tmp_path / "vicuna"), "vicuna holds none of pytorch_model.bin, model.safetensors"),
             (lambda: load_draft(lm, _not_eagle(tmp_path)), "neither an EAGLE-1/2 draft"),
             (lambda: load_draft(target(layers=2), _eagle3(tmp_path)), "at least 7 are needed")]
    for load, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            load()
        assert "\n" not in str(e.value) and str(e.value).startswith("decoder.")
    assert load_heads(lm, tmp_path / "vicuna", check_base=False).k == 3  # the same model under another name


def _not_eagle(tmp_path):
    (tmp_path / "other").mkdir()
    save_file({"lm_head.weight": torch.zeros(64, 64)}, str(tmp_path / "other" / "model.safetensors"))
    (tmp_path / "other" / "config.json").write_text(json.dumps({"hidden_size": 64, "vocab_size": 64}))
    return tmp_path / "other"


def _eagle3(tmp_path):
    write_eagle3(tmp_path / "e3", target(layers=8), seed=0)
    return tmp_path / "e3"


def test_a_hub_id_goes_through_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    lm = target()
    write_medusa(tmp_path / "snapshot", lm, seed=0)
    asked = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.append((repo_id, allow_patterns))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert load_heads(lm, "FasterDecoding/medusa-tiny").k == 3
    assert asked == [("FasterDecoding/medusa-tiny", ["config.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt"])]
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on machines without the hub: one line, naming the id
    with pytest.raises(ValueError,
                       match="decoder.draft_weights: yuhuili/EAGLE-tiny is neither a local directory nor a hub id"):
        load_draft(lm, "yuhuili/EAGLE-tiny")


@pytest.mark.slow
def test_cli_refuses_a_checkpoint_for_another_base_model_with_exit_2(tmp_path):
    """The run's usage-error path: one line naming both models, exit code 2."""
    from helpers import run_cli

    lm = tiny_lm(seed=0, vocab=8)  # hidden 64 as model=tiny-random; the file holds no vocabulary-sized tensor
    write_medusa(tmp_path / "heads", lm, seed=0, own_outputs=False, base="lmsys/vicuna-7b-v1.3")
    out = run_cli("model=tiny-random", "gen.max_new_tokens=8", "decoder=medusa", f"decoder.heads={tmp_path / 'heads'}",
                  f"hydra.run.dir={tmp_path / 'run'}")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "made for base model lmsys/vicuna-7b-v1.3; the target is tiny-random" in lines[0]


def test_published_trees_are_the_authors():
    """decoder.tree=mc_sim_7b_63 (EAGLE) and decoder.choices=mc_sim_7b_63 (Medusa) are the authors'
    trees, which differ under one name: EAGLE-1's is eagle-llm's own list (the oracle: its 25 paths),
    and the static tree we build from it is the one the authors' generate_tree_buffers builds (the
    same ancestors and depth for every node); Medusa-1's holds 63 prefix-closed paths of depth <= 4."""
    from eagle.model.choices import mc_sim_7b_63 as authors
    from eagle.model.utils import generate_tree_buffers

    from decoders.core.tree import published_trees, rank_tree

    eagle, medusa = published_trees()["eagle"]["mc_sim_7b_63"], published_trees()["medusa"]["mc_sim_7b_63"]
    assert eagle == [tuple(p) for p in authors] and len(eagle) == 25
    parents, slots = rank_tree(eagle)
    buffers = generate_tree_buffers(authors, device="cpu")
    ancestors = torch.eye(len(parents))
    for node in range(1, len(parents)):
        parent = node
        while parent > 0:
            parent = parents[parent]
            ancestors[node, parent] = 1
    assert torch.equal(ancestors, buffers["tree_attn_mask"][0, 0].float())
    assert [0] + [depth + 1 for depth, _ in slots] == buffers["tree_position_ids"].tolist()
    assert len(medusa) == 63 and max(map(len, medusa)) == 4 and rank_tree(medusa)[0][0] == -1


def _edit_metadata(path, out, drop=(), state_edit=None, **set_meta):
    """A copy of a weights file with its metadata (and maybe its tensors) changed."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta, state = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    for key in drop:
        meta.pop(key)
    meta.update(set_meta)
    if state_edit:
        state = state_edit(state)
    save_file(state, str(out), metadata=meta)
    return out


def test_a_malformed_draft_or_heads_file_is_one_line_naming_it(tmp_path):
    """A file with our format tag but no hidden_size (KeyError), a
    non-numeric one ('invalid literal for int()' naming neither key nor file), tensors of the wrong
    shape (RuntimeError), a published config.json that is a list (AttributeError) or whose
    vocab_size or hidden_size is a list (TypeError) were tracebacks. Each is now a ValueError, one
    line naming the setting and the file, which the run prints with exit 2."""
    from decoders.methods.eagle_draft import new_draft, save_draft
    from decoders.methods.heads import new_heads, save_heads

    lm = target()
    save_draft(new_draft(lm, seed=0), tmp_path / "draft.safetensors", {"model": NAME})
    save_heads(new_heads(lm, 2), tmp_path / "heads.safetensors", {"model": NAME})
    draft, heads = tmp_path / "draft.safetensors", tmp_path / "heads.safetensors"
    write_eagle1(tmp_path / "e1", lm, seed=0)
    config = json.loads((tmp_path / "e1" / "config.json").read_text())

    def published(name, body):
        shutil.copytree(tmp_path / "e1", tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(body))
        return tmp_path / name

    half = lambda state: {k: v[: max(1, v.shape[0] // 2)] for k, v in state.items()}  # noqa: E731
    cases = [
        (lambda: load_draft(lm, _edit_metadata(draft, tmp_path / "a.safetensors", drop=["hidden_size"])),
         "a.safetensors does not record hidden_size"),
        (lambda: load_draft(lm, _edit_metadata(draft, tmp_path / "b.safetensors", hidden_size="sixty")),
         "b.safetensors records hidden_size='sixty', not a whole number"),
        (lambda: load_draft(lm, _edit_metadata(draft, tmp_path / "c.safetensors", state_edit=half)),
         "c.safetensors does not hold an EAGLE draft of this target's shape"),
        (lambda: load_draft(lm, _edit_metadata(draft, tmp_path / "d.safetensors", vocab="[1, 2")),
         "d.safetensors records vocab that is not JSON"),
        (lambda: load_draft(lm, _edit_metadata(draft, tmp_path / "e.safetensors", info="[1]")),
         "e.safetensors has metadata info that is not a JSON object"),
        (lambda: load_heads(lm, _edit_metadata(heads, tmp_path / "f.safetensors", k="two")),
         "f.safetensors records k='two', not a whole number"),
        (lambda: load_heads(lm, _edit_metadata(heads, tmp_path / "g.safetensors", state_edit=half)),
         "g.safetensors does not hold heads of this target's shape"),
        (lambda: load_draft(lm, published("list", [config])), "config.json holds a JSON list, not an object"),
        (lambda: load_draft(lm, published("vocab", {**config, "vocab_size": [64]})),
         "records vocab_size=[64], not a whole number"),
        (lambda: load_draft(lm, published("layers", {**config, "num_attention_heads": [4]})),
         "config.json does not describe a draft that can be built"),
    ]
    for load, message in cases:
        with pytest.raises(ValueError) as e:
            load()
        assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("decoder."), e.value
