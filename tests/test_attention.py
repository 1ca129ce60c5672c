"""decoders/core/attention.py: grouped-query attention without copying the cache equals attention over
the copied heads, row by row, and the LM's "sdpa" is served by it."""
import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from decoders.core import attention
from helpers import tiny_lm


class Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def reference(query, key, value, mask):
    """Attention in float64 over the key / value heads copied G times (what repeat_kv does); mask bool."""
    groups = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query.double() @ k.transpose(-1, -2) / query.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, q, H, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("batch", [1, 2])
def test_grouped_attention_equals_attention_over_copied_heads(dtype, q, batch):
    gen = torch.Generator().manual_seed(q * 10 + batch)
    heads, kv_heads, dim, cached = 6, 2, 16, 11
    length = cached + q
    query = torch.randn(batch, q, heads, dim, generator=gen).to(dtype).transpose(1, 2)  # as the model lays it out
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype) for _ in range(2))
    # every row its own pattern (a tree's ancestors), so rows given another row's mask would show
    mask = torch.rand(batch, 1, q, length, generator=gen) < 0.6
    mask[..., 0] = True
    out, weights = attention.grouped_sdpa(Module(heads // kv_heads), query, key, value, mask)
    assert weights is None and out.shape == (batch, q, heads, dim) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference(query, key, value, mask), atol=tol, rtol=tol)
    # the negative control: the same rows with each mask row moved to the next row's place differ
    shifted = reference(query, key, value, mask.roll(1, dims=2))
    if q > 1:
        assert (out.double() - shifted).abs().max() > 10 * tol
    if q == 1:  # one new token, no mask (the autoregressive step): all of the cache
        out, _ = attention.grouped_sdpa(Module(heads // kv_heads), query, key, value, None)
        torch.testing.assert_close(out.double(), reference(query, key, value, None), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, q, stacked", [(torch.bfloat16, 1, True), (torch.bfloat16, 2, False),
                                               (torch.float32, 1, False), (torch.float32, 8, False)])
def test_query_heads_are_stacked_as_rows_where_measured_faster(monkeypatch, dtype, q, stacked):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, **kw):
        calls.append((query.shape, kw))
        return sdpa(query, key, value, **kw)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    query = torch.randn(1, 6, q, 16, dtype=dtype)
    key = value = torch.randn(1, 2, 20, 16, dtype=dtype)
    attention.grouped_sdpa(Module(3), query, key, value, torch.ones(1, 1, q, 20, dtype=torch.bool))
    (shape, kw), = calls
    assert (tuple(shape), kw.get("enable_gqa", False)) == (((1, 2, 3, 16), False) if stacked
                                                           else ((1, 6, q, 16), True))


def test_what_it_does_not_serve_goes_to_transformers_sdpa(monkeypatch):
    seen = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **kw: seen.append(kw) or ("hf", None))
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    assert attention.grouped_sdpa(Module(2), query, key, key, None)[0] == "hf"  # a causal prefill
    assert attention.grouped_sdpa(Module(1), query, key.repeat(1, 2, 1, 1), key.repeat(1, 2, 1, 1), None)[0] == "hf"
    per_head = torch.ones(1, 4, 3, 3, dtype=torch.bool)
    assert attention.grouped_sdpa(Module(2), query, key, key, per_head)[0] == "hf"
    assert attention.grouped_sdpa(Module(2), query[:, :, :1], key, key, None, dropout=0.1)[0] == "hf"
    assert len(seen) == 4


def test_the_lm_serves_sdpa_with_it():
    lm = tiny_lm()
    assert lm.model.config.num_key_value_heads < lm.model.config.num_attention_heads  # grouped
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is attention.grouped_sdpa
