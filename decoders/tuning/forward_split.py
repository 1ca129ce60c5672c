"""Where a forward's time goes on this device, and what holds it back.

A forward is split into the linear layers (the vocabulary head included), attention (the function
transformers' attention modules call), and the rest: norms, rotary embeddings, activations,
residual adds, the cache, and the Python between them. The linears are then set against the
machine's two limits: the weight bytes they read, against the measured read bandwidth, and the
multiply-adds they do, against a large matmul's measured rate. `scripts/profile_device.py --split`
prints this per forward width: where a goal is missed, the profile says which kernel or operation
holds it back.

The timers wrap each Linear class's forward (only the outermost call counts) and transformers'
attention lookup, and only while `timed` runs: the profile's curves are measured without them. A
compiled forward calls neither from Python, so only eager paths can be split.
"""
from __future__ import annotations

import random
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..core.lm import LM
from .profile import primed_cache, timed_forward


@dataclass
class Split:
    """One forward of `tokens` new tokens (0: the autoregressive step, one token without a mask)."""
    tokens: int
    total_s: float
    linear_s: float
    attention_s: float
    linear_bytes: int  # every linear weight, read once
    linear_flops: float  # 2 x rows x in x out, summed over the linears

    @property
    def rest_s(self) -> float:
        return self.total_s - self.linear_s - self.attention_s


@contextmanager
def timed(model: nn.Module):
    """While open, the seconds spent in `model`'s linear layers and attention accumulate in the
    yielded dict ("linear", "attention"); the classes and the lookup are restored on exit."""
    spent = {"linear": 0.0, "attention": 0.0}
    classes = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
    originals = {cls: cls.__dict__.get("forward") for cls in classes}
    depth = [0]  # a subclass's forward may call nn.Linear's: only the outermost call is timed

    def wrap(forward):
        def timed_forward(self, x):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return forward(self, x)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent["linear"] += time.perf_counter() - start
        return timed_forward

    lookup = ALL_ATTENTION_FUNCTIONS.get_interface

    def timed_lookup(name, default):
        attend = lookup(name, default)

        def timed_attention(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attend(*args, **kwargs)
            finally:
                spent["attention"] += time.perf_counter() - start
        return timed_attention

    for cls in classes:
        cls.forward = wrap(cls.forward)
    ALL_ATTENTION_FUNCTIONS.get_interface = timed_lookup
    try:
        yield spent
    finally:
        del ALL_ATTENTION_FUNCTIONS.get_interface  # the instance attribute: the class's method shows again
        for cls, forward in originals.items():
            if forward is None:
                del cls.forward  # it had inherited its forward
            else:
                cls.forward = forward


def linear_work(model: nn.Module, rows: int) -> tuple[int, float]:
    """Bytes of every linear weight (each distinct tensor once) and the FLOPs of `rows` rows through them all."""
    weights = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            weights[m.weight.data_ptr()] = m.weight
    n_bytes = sum(w.numel() * w.element_size() for w in weights.values())
    flops = sum(2.0 * rows * m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    return n_bytes, flops


def split_forwards(lm: LM, sizes: list[int], context: int = 256, repeats: int = 7, seed: int = 0) -> list[Split]:
    """Per size (0 = the autoregressive step), the median of `repeats` forwards after `context` cached
    tokens (profile.timed_forward), split by `timed`."""
    ids, cache = primed_cache(lm, context, max(sizes + [1]), random.Random(seed))

    def one(k: int, spent: dict) -> tuple[float, float, float]:
        spent["linear"] = spent["attention"] = 0.0
        return timed_forward(lm, ids, cache, context, k), spent["linear"], spent["attention"]

    splits = []
    with timed(lm.model) as spent:
        for k in sizes:
            one(k, spent)  # warm-up
            runs = sorted((one(k, spent) for _ in range(repeats)), key=lambda r: r[0])
            total, linear, attention = runs[len(runs) // 2]
            n_bytes, flops = linear_work(lm.model, max(k, 1))
            splits.append(Split(k, total, linear, attention, n_bytes, flops))
    return splits


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 1536, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` (n x n) @ (n x n) matmuls on the run's threads: what this
    machine's GEMM reaches when the work is large, the ceiling a compute-bound linear is set against."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        if i:
            best = min(best, time.perf_counter() - start)
    return 2.0 * n ** 3 / best


def held_back_by(split: Split, read_bandwidth: float, peak_flops: float) -> str:
    """What keeps the forward furthest from its limit, in words: of the linears' time above their own limit
    (their weights read at the read bandwidth, or their multiply-adds at the matmul rate, whichever takes
    longer), attention's and the rest's (whose limits are not modelled: all of their time counts), the
    largest; and how near the linears run to their limit."""
    memory, compute = split.linear_bytes / read_bandwidth, split.linear_flops / peak_flops
    limit = max(memory, compute)
    above = {"linears above their limit": split.linear_s - limit, "attention": split.attention_s,
             "the rest (norms, rotary, activations, cache, Python)": split.rest_s}
    worst = max(above, key=above.get)
    bound = "memory" if memory >= compute else "compute"
    near = limit / split.linear_s if split.linear_s else float("nan")
    return f"{worst} ({above[worst] * 1e3:.1f} ms); linears at {near:.0%} of their {bound} limit"


def split_table(splits: list[Split], read_bandwidth: float, peak_flops: float):
    """The splits as a table (a pandas DataFrame), one row per size, ms and each limit's share."""
    import pandas as pd

    step = next((s.total_s for s in splits if s.tokens == 0), None)
    rows = []
    for s in splits:
        rows.append({
            "tokens": s.tokens if s.tokens else "1 (step)",
            "total_ms": s.total_s * 1e3,
            "vs_step": s.total_s / step if step else float("nan"),
            "linears_ms": s.linear_s * 1e3,
            "attention_ms": s.attention_s * 1e3,
            "rest_ms": s.rest_s * 1e3,
            "linears_GB_s": s.linear_bytes / s.linear_s / 1e9 if s.linear_s else float("nan"),
            "of_read_bw": s.linear_bytes / s.linear_s / read_bandwidth if s.linear_s else float("nan"),
            "linears_GFLOP_s": s.linear_flops / s.linear_s / 1e9 if s.linear_s else float("nan"),
            "of_matmul_rate": s.linear_flops / s.linear_s / peak_flops if s.linear_s else float("nan"),
            "held_back_by": held_back_by(s, read_bandwidth, peak_flops),
        })
    return pd.DataFrame(rows)

