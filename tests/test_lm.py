"""The LM wrapper: custom masks and positions, cache crop/keep, hidden states."""
import pytest
import torch

from decoders import TokenTree
from decoders.core.kv_cache import KVCache
from decoders.core.loop import layout
from helpers import tiny_lm

PROMPT = [3, 17, 22, 5, 9, 41, 2, 33]


def fresh_logits(lm, ids):
    return lm.forward(ids, lm.new_cache())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_explicit_causal_mask_and_positions_match_default(attn, seed):
    lm = tiny_lm(seed=seed, attn=attn)
    cache = lm.new_cache()
    lm.forward(PROMPT[:5], cache)
    new = PROMPT[5:]
    mask = torch.ones(len(new), len(cache) + len(new), dtype=torch.bool).tril(diagonal=len(cache))
    explicit = lm.forward(new, cache, position_ids=torch.arange(5, 8), mask=mask)
    assert torch.allclose(explicit, fresh_logits(lm, PROMPT)[5:], atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tree_pass_equals_each_path_run_alone(attn, seed):
    lm = tiny_lm(seed=seed, attn=attn)
    gen = torch.Generator().manual_seed(seed)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5]
    tokens = torch.randint(0, 64, (len(parents),), generator=gen).tolist()
    tree = TokenTree(tokens, parents)
    cache = lm.new_cache()
    lm.forward(PROMPT, cache)
    mask, positions = layout(len(PROMPT), 1, tree)  # the root, uncached, then the tree
    logits = lm.forward(tree.tokens, cache, position_ids=positions, mask=mask)
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path(node)]
        assert torch.allclose(logits[node], fresh_logits(lm, PROMPT + path)[-1], atol=1e-5), node


@pytest.mark.parametrize("seed", [0, 1])
def test_keep_accepted_path_then_continue_equals_recompute(seed):
    lm = tiny_lm(seed=seed)
    tree = TokenTree([7, 11, 12, 13, 14, 15], [-1, 0, 0, 2, 2, 4])
    cache = lm.new_cache()
    lm.forward(PROMPT, cache)
    mask, positions = layout(len(PROMPT), 1, tree)
    lm.forward(tree.tokens, cache, position_ids=positions, mask=mask)
    path = tree.path(5)  # nodes 0, 2, 4, 5: not contiguous in the cache
    cache.keep(list(range(len(PROMPT))) + [len(PROMPT) + i for i in path])
    assert len(cache) == len(PROMPT) + len(path)
    committed = PROMPT + [tree.tokens[i] for i in path]
    after = lm.forward([21, 22], cache)
    assert torch.allclose(after, fresh_logits(lm, committed + [21, 22])[-2:], atol=1e-5)


def test_keep_identity_prefix_is_a_crop():
    lm = tiny_lm()
    cache = lm.new_cache()
    lm.forward(PROMPT, cache)
    cache.keep(range(5))
    assert len(cache) == 5
    assert torch.allclose(lm.forward(PROMPT[5:], cache), fresh_logits(lm, PROMPT)[5:], atol=1e-5)


def test_crop_rolls_back_rejected_tokens():
    lm = tiny_lm()
    cache = lm.new_cache()
    lm.forward(PROMPT, cache)
    lm.forward([1, 2, 3], cache)  # a rejected draft
    cache.crop(len(PROMPT))
    assert len(cache) == len(PROMPT)
    assert torch.allclose(lm.forward([40], cache)[-1], fresh_logits(lm, PROMPT + [40])[-1], atol=1e-5)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(len(cache) + 1)


def cache_state(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.hf.layers]


@pytest.mark.parametrize("reserve", [0, 3, 64])
def test_the_slab_holds_what_a_dynamic_cache_holds_through_growth_keep_and_crop(reserve):
    """A KVSlab (the default cache: one tensor for every layer) against transformers' DynamicCache, edited
    the same way: the same keys and values, bitwise, after a prefill, a tree, a keep that moves
    positions, a crop, and growth past a reserve of 3 positions (grown at every forward) or 64 (never)."""
    lm = tiny_lm(seed=4)
    slab, plain = lm.new_cache(reserve=reserve), KVCache.for_model(lm.config, slab=False)
    assert slab.slab is not None and plain.slab is None
    tree = TokenTree([7, 11, 12, 13, 14, 15], [-1, 0, 0, 2, 2, 4])
    mask, positions = layout(len(PROMPT), 1, tree)
    for cache in (slab, plain):
        lm.forward(PROMPT, cache)
        lm.forward(tree.tokens, cache, position_ids=positions, mask=mask)
    assert all(torch.equal(a, b) for pa, pb in zip(cache_state(slab), cache_state(plain)) for a, b in zip(pa, pb))
    for edit in (lambda c: c.keep([*range(len(PROMPT)), *(len(PROMPT) + i for i in tree.path(5))]),
                 lambda c: lm.forward([21, 22, 23], c), lambda c: c.crop(len(PROMPT) + 5),
                 lambda c: lm.forward(list(range(30, 40)), c)):
        for cache in (slab, plain):
            edit(cache)
        assert len(slab) == len(plain)
        assert all(torch.equal(a, b) for pa, pb in zip(cache_state(slab), cache_state(plain)) for a, b in zip(pa, pb))


def test_the_slab_refuses_a_layer_of_another_shape_and_holds_sliding_layers_whole():
    lm = tiny_lm()
    cache = lm.new_cache()
    lm.forward(PROMPT, cache)
    k = cache.hf.layers[0].keys
    with pytest.raises(ValueError, match="every layer's keys must be"):
        cache.slab.grow(k[:, :1], len(cache) + 100)
    assert cache.positions is None  # full attention: no layer compares positions
    from transformers import MistralConfig
    windowed = MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, sliding_window=4)
    # a sliding layer keeps its whole history too (its mask applies the window): one slab, one edit for all
    assert KVCache.for_model(windowed, positions=True).slab is not None


def test_a_sliding_models_cache_keeps_each_slots_position():
    """What the window compares: positions, through a tree's keep and a chain's crop."""
    from test_model_families import family_lm

    lm = family_lm("mistral", "none")
    cache = lm.new_cache()
    lm.forward(list(range(10)), cache)
    mask = torch.ones(3, 13, dtype=torch.bool)
    mask[:, 10:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    lm.forward([1, 2, 3], cache, position_ids=torch.tensor([10, 11, 11]), mask=mask)
    assert cache.positions.tolist() == [*range(10), 10, 11, 11]
    cache.keep([*range(10), 10, 12])
    assert cache.positions.tolist() == [*range(12)]
    cache.crop(5)
    assert cache.positions.tolist() == [*range(5)]


def test_last_only_and_hidden_state():
    lm = tiny_lm()
    full, hidden = lm.forward(PROMPT, lm.new_cache(), hidden=True)
    last, last_hidden = lm.forward(PROMPT, lm.new_cache(), last_only=True, hidden=True)
    assert full.shape == (len(PROMPT), 64) and hidden.shape == (len(PROMPT), 64)
    assert last.shape == (1, 64) and last_hidden.shape == (1, 64)
    assert torch.allclose(last[0], full[-1], atol=1e-5)
    # The hidden state is what the output head reads.
    with torch.inference_mode():
        assert torch.allclose(lm.model.get_output_embeddings()(hidden), full, atol=1e-4)
    assert torch.allclose(lm.forward(PROMPT, lm.new_cache()), full)  # no hidden requested: logits only


def test_features_are_every_row_before_the_final_norm():
    """features=True (EAGLE's input): the last layer's output before the final norm, for every fed
    row even when only some rows' logits are kept."""
    lm = tiny_lm()
    full, hidden = lm.forward(PROMPT, lm.new_cache(), hidden=True)
    last, features = lm.forward(PROMPT, lm.new_cache(), logits_last=2, features=True)
    assert features.shape == (len(PROMPT), 64) and torch.allclose(last, full[-2:], atol=1e-5)
    with torch.inference_mode():
        assert torch.allclose(lm.final_norm(features), hidden, atol=1e-5)
    with pytest.raises(ValueError, match="hidden or features"):
        lm.forward(PROMPT, lm.new_cache(), hidden=True, features=True)


def test_mask_shape_and_missing_positions_are_errors():
    lm = tiny_lm()
    cache = lm.new_cache()
    lm.forward(PROMPT, cache)
    with pytest.raises(ValueError, match="mask shape"):
        lm.forward([1, 2], cache, position_ids=[8, 9], mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="position_ids"):
        lm.forward([1, 2], cache, mask=torch.ones(2, 10, dtype=torch.bool))


def test_flops_spec_counts_matmul_parameters():
    lm = tiny_lm(vocab=64, hidden=64, layers=2)
    spec = lm.flops_spec()
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128  # q,o + k,v (2 kv heads of 16) + mlp
    assert spec["matmul_params"] == 2 * per_layer + 64 * 64 + (2 * 2 + 1) * 64  # + untied head + RMSNorm weights
    assert spec["n_layers"] == 2 and spec["d_attn"] == 64


def test_stop_ids_from_config_and_tokenizer():
    assert tiny_lm(eos=5).stop_ids == {5}
    assert tiny_lm(eos=None).stop_ids == frozenset()
