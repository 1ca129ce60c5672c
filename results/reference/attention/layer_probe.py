"""The per-layer numbers in README.md and decoders/core/attention.py's docstring: one attention call of
SmolLM2-135M's shape (9 query heads, 3 key/value heads, head dim 64, 256 cached + q new), median of
400 calls interleaved with the others', 2 threads, in three ways: transformers' copy of every
key/value head per query head (`repeat_kv`, its path for masked and compiled forwards), SDPA's
enable_gqa, and grouped_sdpa's rows.
Run from the repository root: python results/reference/attention/layer_probe.py"""
import random
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


def medians_us(functions: dict, rounds: int = 40, calls: int = 10) -> dict:
    """Each function's median call, the functions interleaved: `rounds` rounds in a fresh random order."""
    for fn in functions.values():
        for _ in range(20):
            fn()
    times = {name: [] for name in functions}
    for _ in range(rounds):
        for name in random.sample(list(functions), len(functions)):
            for _ in range(calls):
                start = time.perf_counter()
                functions[name]()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:  # transformers' copy of a key/value head per query head
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


print(f"{torch.__version__}, 2 threads; microseconds per call, each returning (1, q, heads, dim) as transformers' "
      "attention functions do: repeat_kv / enable_gqa / grouped_sdpa")
random.seed(0)
groups, module = HEADS // KV_HEADS, Attention()
for dtype in (torch.bfloat16, torch.float32):
    for q in (1, 2, 4, 8, 16, 32):
        query = torch.randn(1, q, HEADS, DIM, dtype=dtype).transpose(1, 2)  # as the model lays it out
        key, value = (torch.randn(1, KV_HEADS, CACHED + q, DIM, dtype=dtype) for _ in range(2))
        mask = torch.ones(q, CACHED + q, dtype=torch.bool)
        mask[:, CACHED:] = torch.tril(mask[:, CACHED:])
        mask = mask[None, None]
        functions = {
            "copied": lambda: F.scaled_dot_product_attention(
                query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask).transpose(1, 2).contiguous(),
            "gqa": lambda: F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, enable_gqa=True).transpose(1, 2).contiguous(),
            "grouped": lambda: grouped_sdpa(module, query, key, value, mask)[0]}
        us = medians_us(functions)
        print(f"{str(dtype).replace('torch.', ''):>8} q={q:<2} " + " / ".join(f"{us[n]:6.1f}" for n in functions),
              flush=True)
