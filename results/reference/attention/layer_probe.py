"""The per-layer numbers in README.md and decoders/core/attention.py's docstring: one attention call of
SmolLM2-135M's shape (9 query heads, 3 key/value heads, head dim 64, 256 cached + q new), median of
300 calls, 2 threads, in three ways: transformers' copy of every key/value head per query head
(`repeat_kv`, its path for masked and compiled forwards), SDPA's enable_gqa, and grouped_sdpa's rows.
Run from the repository root: python results/reference/attention/layer_probe.py"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from decoders.core.attention import grouped_sdpa  # noqa: E402

torch.set_num_threads(2)
HEADS, KV_HEADS, DIM, CACHED = 9, 3, 64, 256


class Attention(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS


def median_us(fn, calls=300):
    for _ in range(30):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


print(f"{torch.__version__}, 2 threads; microseconds per call: repeat_kv / enable_gqa / grouped_sdpa")
for dtype in (torch.bfloat16, torch.float32):
    for q in (1, 2, 4, 8, 16, 32):
        query = torch.randn(1, HEADS, q, DIM, dtype=dtype)
        key, value = (torch.randn(1, KV_HEADS, CACHED + q, DIM, dtype=dtype) for _ in range(2))
        mask = torch.ones(q, CACHED + q, dtype=torch.bool)
        mask[:, CACHED:] = torch.tril(mask[:, CACHED:])
        mask = mask[None, None]
        groups = HEADS // KV_HEADS
        copied = (lambda: F.scaled_dot_product_attention(  # noqa: E731
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask))
        gqa = lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)  # noqa: E731
        ours = lambda: grouped_sdpa(Attention(), query, key, value, mask)  # noqa: E731
        print(f"{str(dtype).replace('torch.', ''):>8} q={q:<2} {median_us(copied):6.1f} / {median_us(gqa):6.1f} / "
              f"{median_us(ours):6.1f}", flush=True)
