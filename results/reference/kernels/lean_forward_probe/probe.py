"""Probe: does transformers' module structure cost the kernel path's forward much? SmolLM2-135M on
model.fast_path=kernel, float32, 2 threads: LM.forward against a hand-written loop over the same modules
and kernels (gpt-fast's shape: embed, per layer norm / q k v / fused rotary / cache / SDPA / o / norm / MLP),
1 and 8 new tokens after 256 cached, interleaved rounds, medians; the logits must be bitwise equal.

    BENCH_DATA_DIR=../shared/data python results/reference/kernels/lean_forward_probe/probe.py
"""
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
from decoders.core import kernels  # noqa: E402
from decoders.tuning.profile import primed_cache  # noqa: E402

CONTEXT, ROUNDS = 256, 30
torch.set_num_threads(2)
with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
    cfg = compose("config", overrides=[])
lm = instantiate(cfg.model, fast_path="kernel", compile="none").load()
base = lm.model.model
head_dim = base.layers[0].self_attn.head_dim
rotary_module = sys.modules[type(base.layers[0].self_attn).__bases__[-1].__module__]  # KernelLlamaAttention's base
rotary = getattr(rotary_module.apply_rotary_pos_emb, "original", rotary_module.apply_rotary_pos_emb)


def lean(ids, positions, mask, cache, rows):
    h = base.embed_tokens(ids)
    cos, sin = base.rotary_emb(h, positions)
    B, T, _ = h.shape
    kernels._in_kernel_attention.on = True
    for i, layer in enumerate(base.layers):
        a, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(B, T, -1, head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, -1, head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, -1, head_dim).transpose(1, 2)
        q, k = kernels.fused_rotary(q, k, cos, sin, rotary)
        k, v = cache.update(k, v, i)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=a.scaling, enable_gqa=True)
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        x = layer.post_attention_layernorm(h)
        h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    kernels._in_kernel_attention.on = False
    return lm.model.lm_head(base.norm(h)[0, -rows:])


times, outs = {}, {}
with torch.inference_mode():
    ids, cache = primed_cache(lm, CONTEXT, 8, random.Random(0))
    for r in range(ROUNDS + 1):
        for kind in (("LM.forward", "lean") if r % 2 else ("lean", "LM.forward")):
            for k in (1, 8):
                new = ids[CONTEXT:CONTEXT + k]
                mask = torch.ones(k, CONTEXT + k, dtype=torch.bool)
                mask[:, CONTEXT:] = torch.tril(mask[:, CONTEXT:])
                start = time.perf_counter()
                if kind == "lean":
                    out = lean(torch.tensor(new).reshape(1, -1), torch.arange(CONTEXT, CONTEXT + k).reshape(1, -1),
                               mask[None, None] if k > 1 else None, cache.hf, k)
                elif k == 1:
                    out = lm.forward(new, cache, last_only=True)
                else:
                    out = lm.forward(new, cache, position_ids=torch.arange(CONTEXT, CONTEXT + k), mask=mask,
                                     logits_last=k)
                elapsed = time.perf_counter() - start
                cache.crop(CONTEXT)
                if r:  # round 0 warms up
                    times.setdefault((kind, k), []).append(elapsed * 1e3)
                outs[(kind, k)] = out
cpu = open("/proc/cpuinfo").read().split("model name")[1].split(":")[1].splitlines()[0].strip()
print(f"{lm.name} float32, fast path {lm.fast_path}, {torch.get_num_threads()} threads, {cpu}, {ROUNDS} rounds")
for k in (1, 8):
    full, lean_ms = (statistics.median(times[(kind, k)]) for kind in ("LM.forward", "lean"))
    spread = {kind: (min(times[(kind, k)]), max(times[(kind, k)])) for kind in ("LM.forward", "lean")}
    same = torch.equal(outs[("LM.forward", k)], outs[("lean", k)])
    lo, hi = spread["LM.forward"]
    print(f"{k} tokens: LM.forward {full:.2f} ms (min {lo:.2f}, max {hi:.2f}),"
          f" lean {lean_ms:.2f} ms (min {spread['lean'][0]:.2f}, max {spread['lean'][1]:.2f}):"
          f" {full - lean_ms:.2f} ms less ({(full - lean_ms) / full:.1%}); logits bitwise equal: {same}")
