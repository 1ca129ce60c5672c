"""Spec-Bench's A100 leaderboard beside bench.forecast's roofline.

    python results/reference/forecast/spec_bench_a100/spec_bench_forecast.py
        [--out results/reference/forecast/spec_bench_a100]

Spec-Bench publishes, per method on Vicuna-7B-v1.3 on an A100, the mean accepted tokens per step
(tau) and the measured speedup. What a step costs is the forecast's part: per method, one step is
a target forward of the method's verification width (tokens fed) after CONTEXT cached tokens,
plus the draft's forwards of that step, each priced by its own size on the same roofline
(bench.forecast.Roofline.model_forward_ms: weights read once, FLOPs by
decoders.core.lm.forward_flops). The autoregressive step is a one-token forward, and

    forecast speedup = tau x autoregressive step / method step.

Two rooflines (results/reference/forecast/): (a) a100_roofline.yaml, the datasheet's bandwidth and
peak and nothing per forward; (b) a100_eager_host.yaml, the same plus the host overhead this
harness measured for an eager float16 7B forward (its fixed_ms), charged to a draft's forward in
proportion to its weight matrices (the host launches kernels per weight matrix; a 7B forward has
225). No constant is fitted to Spec-Bench's speedups. Each method's width and draft come from
Spec-Bench's own scripts (hemingkx/Spec-Bench at fd2c1cd); the sources are in METHODS.

Writes OUT/forecast.csv and OUT/README.md (the table, the assumptions with their sources, what
explains the largest errors, and the provenance).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from bench import provenance, rundir
from bench.forecast import Roofline, read_curves, read_roofline

REPO = Path(__file__).resolve().parents[4]
PROFILES = {"a": REPO / "results/reference/forecast/a100_roofline.yaml",
            "b": REPO / "results/reference/forecast/a100_eager_host.yaml"}
OUT = REPO / "results/reference/forecast/spec_bench_a100"
SPEC_BENCH = ("hemingkx/Spec-Bench Leaderboard.md at fd2c1cd, 'Leaderboard on A100', Vicuna-7B-v1.3: greedy, "
              "FP16, batch 1, PyTorch 2.5.1, one A100 80GB with 96 CPU cores; overall speedup, mean of 3 runs")
SB = "Spec-Bench fd2c1cd"  # the code a width or a draft was read from

# A typical Spec-Bench context: its 480 questions average 1,220 characters (about 300 Llama tokens), plus
# the system prompt and half an answer. Below the ridge only attention FLOPs read it, so 0 or 2048
# give the same forecasts (README: the check).
CONTEXT = 512

# Vicuna-7B-v1.3 (lmsys/vicuna-7b-v1.3 config.json): d 4096, FFN 11008, 32 layers of 32 heads, vocab 32000.
D, FFN, LAYERS, VOCAB = 4096, 11008, 32, 32000
LAYER = 4 * D * D + 3 * D * FFN  # a Llama decoder layer's weight matrices: q, k, v, o, gate, up, down


@dataclass(frozen=True)
class Part:
    """A network a forward runs: its flops spec (LM.flops_spec()'s keys) and its weight matrices
    (what (b) charges the host's launches by)."""
    name: str
    matmul_params: float
    n_layers: int
    d_attn: int
    linears: int

    @property
    def spec(self) -> dict:
        return {"matmul_params": self.matmul_params, "n_layers": self.n_layers, "d_attn": self.d_attn}


# LM.flops_spec() of the checkpoint: every parameter but the input embedding (norms included): 6,607,343,616.
TARGET = Part("Vicuna-7B-v1.3", LAYERS * (LAYER + 2 * D) + D + D * VOCAB, LAYERS, D, 7 * LAYERS + 1)
# EAGLE-1/2 for Vicuna-7B (yuhuili/EAGLE-Vicuna-7B-v1.3; Spec-Bench model/eagle*/cnets.py): fc (2d -> d),
# one decoder layer, and the target's lm_head on its output.
EAGLE_DRAFT = Part("EAGLE draft: fc, 1 layer, the target's head", 2 * D * D + LAYER + D * VOCAB, 1, D, 9)
# Medusa-1 (FasterDecoding/medusa-vicuna-7b-v1.3): 5 heads, each one ResBlock (d -> d) and its own d -> V head
# (the published layout this harness's GPU kit draws: results/reference/gpu/2026-11-26-h100/README.md).
MEDUSA_HEADS = Part("5 Medusa-1 heads", 5 * (D * D + D * VOCAB), 0, D, 10)
# Hydra++ (ankner/hydra-vicuna-7b-v1.3; zankner/Hydra README's recipe: 4 heads, 4 layers, prefix-mlp,
# grounded): a prefix decoder layer, then head i: a ResBlock from (i + 2) d to d with a linear residual,
# 3 applications of one d -> d ResBlock, and its own d -> V head (Spec-Bench model/hydra/hydra_heads/).
HYDRA_PREFIX = Part("Hydra prefix layer", LAYER, 1, D, 7)
HYDRA_HEADS = [Part(f"Hydra head {i}", (2 * (i + 2) + 3) * D * D + D * VOCAB, 0, D, 6) for i in range(4)]
# SpS's drafter, vicuna-68m (double7/vicuna-68m, JackFram/llama-68m's shape): d 768, FFN 3072, 2 layers,
# vocab 32000, untied head.
VICUNA_68M = Part("vicuna-68m", 2 * (4 * 768 * 768 + 3 * 768 * 3072) + 768 * VOCAB, 2, 768, 15)


@dataclass(frozen=True)
class Method:
    name: str
    tau: float  # Spec-Bench's mean accepted tokens
    speedup: float  # Spec-Bench's overall speedup
    width: int  # tokens the target is fed per step
    width_source: str
    draft: tuple[tuple[Part, float], ...]  # the draft's forwards in one step, in order: (network, tokens fed)
    draft_source: str


def eagle_forwards(tau: float, levels: list[int]) -> tuple:
    """The draft over the tokens accepted last step, then one forward per tree level."""
    return ((EAGLE_DRAFT, tau), *((EAGLE_DRAFT, n) for n in levels))


METHODS = [
    Method("EAGLE2", 4.34, 2.36, 60, f"{SB} evaluation/inference_eagle2.py: total_token 60 (the root and 59 drafts)",
           eagle_forwards(4.34, [10] * 5),
           f"{SB} model/eagle2/cnets.py topK_genrate: 1 + depth 5 forwards, top_k 10 tokens each after the first"),
    Method("Recycling", 2.73, 2.22, 81, f"{SB} model/recycling/tree_template_.py: template 2.2.2, 80 nodes + root",
           (), f"{SB} evaluation/inference_recycling.py: an adjacency-matrix lookup on the GPU, no network"),
    Method("EAGLE", 3.58, 2.10, 26, f"{SB} model/eagle/choices.py: mc_sim_7b_63, 25 nodes + root",
           eagle_forwards(3.58, [4, 4, 1, 1]),
           f"{SB} model/eagle/cnets.py, utils_c.py: 1 + 4 forwards, one per level of nodes with children"),
    Method("Hydra", 3.26, 2.07, 64, f"{SB} evaluation/inference_hydra.py: mc_sim_7b_63, 63 nodes + root",
           ((HYDRA_PREFIX, 3.26), *((head, n) for head, n in zip(HYDRA_HEADS, [1, 10, 10, 1]))),
           f"{SB} model/hydra/hydra_heads/prefix_mlp_head.py _grounded_proposal: the prefix layer, then 4 heads "
           "in sequence over the tree's levels"),
    Method("Medusa", 2.31, 1.71, 64, f"{SB} evaluation/inference_medusa.py: mc_sim_7b_63, 63 nodes + root",
           ((MEDUSA_HEADS, 64),), f"{SB} model/medusa/medusa_model.py: every head over every fed token, once"),
    Method("PLD", 1.75, 1.66, 11, f"{SB} evaluation/inference_pld.py: up to 10 copied tokens (+ 1)",
           (), f"{SB} model/pld/pld.py: an n-gram match in the sequence, no network"),
    Method("SpS", 2.28, 1.52, 6, f"{SB} inference_sps.py: transformers 4.37.1 assisted generation, "
           "num_assistant_tokens 5 (its default start) + 1",
           ((VICUNA_68M, 2.28), *((VICUNA_68M, 1),) * 4),
           f"{SB} eval.sh: vicuna-68m drafts 5 tokens, one forward each (the first over the new tokens)"),
    Method("REST", 1.82, 1.48, 65, f"{SB} evaluation/inference_rest.py: num_draft 64 (+ 1)",
           (), f"{SB} model/rest/: a suffix-array datastore lookup on the CPU (Rust), not priced"),
    Method("Lookahead", 1.64, 1.34, 56, f"{SB} eval.sh level 5, window 7, guess 7; model/lade/: 1 + 27 "
           "lookahead-branch tokens + up to 7 x 4 guessed", (),
           f"{SB} model/lade/decoding.py: an n-gram pool in Python, no network"),
]

# What this harness measured on GPUs, quoted to explain the errors (not used by the forecasts).
H100_PROFILE = REPO / "results/reference/gpu/2026-11-26-h100/profile.csv"
H200_PROFILE = REPO / "results/reference/gpu/2026-11-26-h200/profile.csv"
H100_DECODERS = REPO / "results/reference/gpu/2026-11-26-h100-attention/call1/big_target.csv"


def forward_ms(roofline: Roofline, part: Part, tokens: float, context: float) -> float:
    """One forward of `part` on the roofline; the fixed cost per forward scaled by its weight matrices
    against the target's (the target pays fixed_ms itself)."""
    scaled = dataclasses.replace(roofline, fixed_ms=roofline.fixed_ms * part.linears / TARGET.linears)
    return scaled.model_forward_ms(part.spec, tokens, context)


def step_ms(method: Method, roofline: Roofline, context: float = CONTEXT) -> tuple[float, float]:
    """(target, draft) ms of one of the method's steps."""
    return (forward_ms(roofline, TARGET, method.width, context),
            sum(forward_ms(roofline, part, tokens, context) for part, tokens in method.draft))


def forecast_speedup(method: Method, roofline: Roofline, context: float = CONTEXT) -> float:
    return method.tau * forward_ms(roofline, TARGET, 1, context) / sum(step_ms(method, roofline, context))


def ridge_tokens(roofline: Roofline, context: float = CONTEXT) -> int:
    """The fewest tokens a target forward costs more for than one token does."""
    one = forward_ms(roofline, TARGET, 1, context)
    return next(k for k in range(2, 100_000) if forward_ms(roofline, TARGET, k, context) > one * (1 + 1e-9))


def describe_draft(method: Method) -> str:
    """The draft's forwards in a step, grouped by network, with its matmul parameters."""
    if not method.draft:
        return "none"
    groups: dict[str, list[tuple[Part, float]]] = {}
    for part, tokens in method.draft:
        groups.setdefault(re.sub(r" \d+$", " i", part.name), []).append((part, tokens))  # Hydra's "head i"
    text = []
    for name, forwards in groups.items():
        sizes = sorted({p.matmul_params / 1e6 for p, _ in forwards})
        size = f"{sizes[0]:.0f}M" if len(sizes) == 1 else f"{sizes[0]:.0f}-{sizes[-1]:.0f}M"
        n = len(forwards)
        text.append(f"{name} ({size}): {n} forward{'s' if n > 1 else ''} of "
                    f"{'/'.join(f'{t:g}' for _, t in forwards)} tokens")
    return "; ".join(text)


def table(rooflines: dict[str, Roofline]) -> pd.DataFrame:
    rows = []
    for m in METHODS:
        row = {"method": m.name, "spec_bench_mean_accepted_tokens": m.tau, "spec_bench_speedup": m.speedup}
        for label, roofline in rooflines.items():
            f = forecast_speedup(m, roofline)
            row[f"forecast_{label}"] = f
            row[f"error_{label}"] = f / m.speedup - 1
        row["width"] = m.width
        row["implied_step_vs_ar"] = m.tau / m.speedup  # Spec-Bench's step in autoregressive steps
        for label, roofline in rooflines.items():
            ar = forward_ms(roofline, TARGET, 1, CONTEXT)
            target, draft = step_ms(m, roofline)
            row |= {f"ar_ms_{label}": ar, f"target_ms_{label}": target, f"draft_ms_{label}": draft,
                    f"step_vs_ar_{label}": (target + draft) / ar}
        row |= {"draft": describe_draft(m),
                "draft_params_read_per_step_m": sum(p.matmul_params for p, _ in m.draft) / 1e6,
                "width_source": m.width_source, "draft_source": m.draft_source}
        rows.append(row)
    return pd.DataFrame(rows)


def width_ratios() -> dict[str, Callable[[int], float]]:
    """This harness's eager k-token forward in one-token steps, by k (profile_device's curves, 7B shape)."""
    curves = {name: read_curves(path)["none"] for name, path in (("H100", H100_PROFILE), ("H200", H200_PROFILE))}
    return {name: (lambda k, c=c: c.forward_ms(k, 0) / c.forward_ms(1, 0)) for name, c in curves.items()}


def md_table(frame: pd.DataFrame, left: tuple[str, ...] = ("method",)) -> str:
    lines = ["| " + " | ".join(frame.columns) + " |",
             "|" + "|".join(":--" if c in left else "--:" for c in frame.columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)])


def pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def evidence(t: pd.DataFrame, rooflines: dict[str, Roofline]) -> dict:
    """The numbers the explanation cites: from the table, and from this harness's GPU measurements."""
    a = rooflines["a"]
    by = t.set_index("method")
    ratio = width_ratios()
    decoders = pd.read_csv(H100_DECODERS).set_index("decoder")
    ar_h100 = decoders.loc["autoregressive", "target_ms_per_step"]
    no_draft = [m for m in METHODS if not m.draft]
    wide = [m.name for m in no_draft if m.width > 50]
    drafted = ["EAGLE2", "EAGLE", "Hydra", "SpS"]
    # (a) with the H100's measured cost of the width in place of the roofline's: a check of the explanation
    checked = {m.name: m.tau / ratio["H100"](m.width) for m in no_draft}
    sensitivity = max(abs(forecast_speedup(m, r, c) / forecast_speedup(m, r) - 1)
                      for m in METHODS for r in rooflines.values() for c in (0, 2048))
    return {
        "by": by, "ridge": ridge_tokens(a) - 1, "widest": max(m.width for m in METHODS),
        "wide": ", ".join(wide), "wide_low": min(by.loc[wide, "implied_step_vs_ar"]),
        "wide_high": max(by.loc[wide, "implied_step_vs_ar"]),
        "wide_errors": ", ".join(f"{n} {pct(by.loc[n, 'error_a'])}" for n in wide),
        "h100_32": ratio["H100"](32), "h100_64": ratio["H100"](64), "h200_64": ratio["H200"](64),
        "checked": ", ".join(f"{n} {v:.2f}x ({pct(v / by.loc[n, 'spec_bench_speedup'] - 1)})"
                             for n, v in checked.items()),
        "residual": ", ".join(f"{n} {by.loc[n, 'implied_step_vs_ar'] - ratio['H100'](int(by.loc[n, 'width'])):.2f}"
                              for n in drafted),
        "draft_a": ", ".join(f"{by.loc[n, 'draft_ms_a'] / by.loc[n, 'ar_ms_a']:.2f}" for n in drafted),
        "eagle_draft": decoders.loc["eagle", "draft_ms_per_step"], "ar_h100": ar_h100,
        "assisted_draft": decoders.loc["hf_assisted", "draft_ms_per_step"],
        "assisted_loop": decoders.loc["hf_assisted", "overhead_ms_per_step"],
        "sensitivity": (f"no forecast moves by more than {100 * sensitivity:.2g}%" if sensitivity
                        else "every forecast is the same"),
    }


def readme(t: pd.DataFrame, rooflines: dict[str, Roofline], commit: str, dirty: bool) -> str:
    b = rooflines["b"]
    e = evidence(t, rooflines)
    by = e["by"]

    def err(name: str, label: str = "a") -> str:
        return pct(by.loc[name, f"error_{label}"])

    def share(name: str, label: str) -> str:
        return f"{by.loc[name, f'draft_ms_{label}'] / by.loc[name, f'ar_ms_{label}']:.2f}"

    worst_a, worst_b = t.loc[t["error_a"].idxmax()], t.loc[t["error_b"].idxmax()]
    main = pd.DataFrame({
        "method": t["method"], "Spec-Bench mean accepted tokens": t["spec_bench_mean_accepted_tokens"],
        "Spec-Bench speedup": t["spec_bench_speedup"].map("{:.2f}x".format),
        "forecast (a)": t["forecast_a"].map("{:.2f}x".format), "error (a)": t["error_a"].map(pct),
        "forecast (b)": t["forecast_b"].map("{:.2f}x".format), "error (b)": t["error_b"].map(pct),
        "width (tokens fed)": t["width"], "draft per step": t["draft"],
        "draft ms (a) / (b)": [f"{x:.2f} / {y:.2f}" for x, y in zip(t["draft_ms_a"], t["draft_ms_b"])]})
    steps = pd.DataFrame({
        "method": t["method"], "Spec-Bench: tau / speedup": t["implied_step_vs_ar"].map("{:.2f}".format),
        "forecast (a)": t["step_vs_ar_a"].map("{:.2f}".format), "forecast (b)": t["step_vs_ar_b"].map("{:.2f}".format),
        "of which draft (a)": (t["draft_ms_a"] / t["ar_ms_a"]).map("{:.2f}".format),
        "of which draft (b)": (t["draft_ms_b"] / t["ar_ms_b"]).map("{:.2f}".format)})
    sources = t[["method", "width_source", "draft_source"]].rename(
        columns={"width_source": "width: source", "draft_source": "draft: source"})
    return f"""# Spec-Bench's A100 table beside the roofline forecast

What `bench/forecast.py`'s pricing says Spec-Bench's methods should gain on an A100, given Spec-Bench's
own mean accepted tokens, set beside the speedups Spec-Bench measured. Nothing here ran on a GPU; the
measured figures are Spec-Bench's: {SPEC_BENCH}.

Per method, one step is a Vicuna-7B forward of the method's width (tokens fed) after {CONTEXT} cached
tokens, plus the draft's forwards in that step, each priced by its own size on the same roofline
(`Roofline.model_forward_ms`: weights read once, FLOPs by `decoders.core.lm.forward_flops`; KV-cache
reads left out); no harness overhead. The autoregressive step is a one-token forward, and
**forecast speedup = mean accepted tokens x autoregressive step / method step**.

- **(a)** `../a100_roofline.yaml`: NVIDIA's datasheet figures for the A100 80GB SXM, 2039 GB/s HBM2e
  and 312 TFLOP/s dense FP16 tensor, nothing per forward. An autoregressive step: {t['ar_ms_a'][0]:.2f} ms
  (the {TARGET.matmul_params / 1e9:.2f}B matmul parameters read once).
- **(b)** `../a100_eager_host.yaml`: the same plus {b.fixed_ms} ms per 7B forward, the host overhead this
  harness *measured* for an eager float16 forward of Vicuna-7B's shape on an H100 (an 18.62 ms step
  against its 5.09 ms weight-read floor, `../../gpu/2026-11-26-h100/profile.csv`; an H200 gave 13.8-14.9
  ms). A draft's forward pays it in proportion to its weight matrices (a 7B forward has {TARGET.linears},
  EAGLE's draft {EAGLE_DRAFT.linears}, vicuna-68m {VICUNA_68M.linears}): an assumption, not a fit. An
  autoregressive step: {t['ar_ms_b'][0]:.2f} ms.

No constant is fitted to Spec-Bench's speedups. Error = forecast / Spec-Bench's speedup - 1.

{md_table(main, ("method", "draft per step"))}

A step's cost in autoregressive steps: Spec-Bench's, implied by its own figures (tau / speedup), and the
forecasts' (method step / autoregressive step), with the draft's part of it.

{md_table(steps)}

## What explains the largest errors

Every forecast is above Spec-Bench's measurement. The largest errors are {worst_a['method']}'s in (a)
({pct(worst_a['error_a'])}) and {worst_b['method']}'s in (b) ({pct(worst_b['error_b'])}), then the other
methods that run a draft network: EAGLE2 {err('EAGLE2')} / {err('EAGLE2', 'b')}, EAGLE {err('EAGLE')} /
{err('EAGLE', 'b')}, Hydra {err('Hydra')} / {err('Hydra', 'b')}. Two costs the roofline does not see explain
them, and the second table separates the two:

1. **Verification is not free.** On this roofline a 7B forward of up to {e['ridge']} tokens costs what one
   token costs (the weights are read once; the FLOPs of even {e['widest']} tokens take less time), so every
   verification is priced as an autoregressive step, and a method without a draft network is forecast at
   exactly its mean accepted tokens. By Spec-Bench's own figures its step costs
   {by.loc['PLD', 'implied_step_vs_ar']:.2f} autoregressive steps for PLD (up to 11 tokens fed) and
   {e['wide_low']:.2f}-{e['wide_high']:.2f} for {e['wide']} (56-81 tokens), none of which runs a draft
   network. This harness measured the same on its eager stack: a forward of 32 or 64 tokens costs
   {e['h100_32']:.2f} / {e['h100_64']:.2f} one-token steps on an H100 ({e['h200_64']:.2f} at 64 on an H200;
   `../../gpu/*/profile.csv`). That width cost is the whole of the errors of {e['wide_errors']}: with the
   H100's measured ratio at each width in place of the roofline's 1.00, (a) would give {e['checked']}
   (PLD feeds 11 tokens only where an n-gram matches, so 11 overstates its width). REST's datastore
   lookups on the CPU, priced at nothing, add nothing visible: its implied step
   ({by.loc['REST', 'implied_step_vs_ar']:.2f}) is Recycling's ({by.loc['Recycling', 'implied_step_vs_ar']:.2f}),
   whose draft is a lookup on the GPU. The width is also most of Medusa's error ({err('Medusa')}): implied
   step {by.loc['Medusa', 'implied_step_vs_ar']:.2f}, forecast {by.loc['Medusa', 'step_vs_ar_a']:.2f} (the heads
   {share('Medusa', 'a')} of it), the H100's 64-token forward {e['h100_64']:.2f}.
2. **A draft network's forwards cost launches, not weight reads.** Take the width's measured cost from
   the implied step and what is left for the draft is, in autoregressive steps, {e['residual']}, against
   {e['draft_a']} on roofline (a). These drafts are small networks run as several forwards in sequence
   (EAGLE2 6, EAGLE 5, Hydra 5, SpS 5, with top-k and tree building between them), each reading little:
   the roofline prices their bytes, an eager stack pays their kernel launches and host work. This harness
   measured it on an H100 (`../../gpu/2026-11-26-h100-attention/call1/big_target.csv`, eager float16, 7B
   shape, untrained drafts): its EAGLE draft of depth 6 took {e['eagle_draft']:.1f} ms a step against a
   {e['ar_h100']:.1f} ms autoregressive step ({e['eagle_draft'] / e['ar_h100']:.2f}), and transformers'
   assisted generation (SpS's loop, a one-layer draft) {e['assisted_draft']:.1f} ms drafting plus
   {e['assisted_loop']:.1f} ms in its own loop ({(e['assisted_draft'] + e['assisted_loop']) / e['ar_h100']:.2f}).
   Forecast (b) adds {b.fixed_ms} ms to every 7B forward, the autoregressive one included, and charges a
   draft's forwards by their weight matrices: the draft's share of a step falls (EAGLE2
   {share('EAGLE2', 'a')} -> {share('EAGLE2', 'b')}, Hydra {share('Hydra', 'a')} -> {share('Hydra', 'b')}), so
   (b) is further off than (a) for every network draft but SpS's, whose 2-layer forwards are nearly all
   launch ({share('SpS', 'a')} -> {share('SpS', 'b')}; error {err('SpS')} -> {err('SpS', 'b')}). The host work
   between a draft's forwards (EAGLE2 builds its tree's mask row by row in a Python loop of 59) scales
   with neither.

## What is uncertain

- The widths are Spec-Bench's settings, not what each step fed: PLD feeds 1 token where no n-gram
  matches, REST up to 64 drafts, and SpS's draft length follows transformers' heuristic schedule (5 is its
  start). Below the ridge ({e['ridge']} tokens) no width changes the roofline's price, so neither forecast
  moves; the explanation's check above does.
- The drafts' sizes are read from the authors' code and recipes (Medusa-1: 5 heads of one layer;
  Hydra++: 4 heads of 4 layers, prefix-mlp, grounded; vicuna-68m: llama-68m's shape), not from the
  checkpoints' config files, which were not at hand.
- (b)'s host overhead was measured on this harness's stack (torch 2.11, a 16-core VM), not Spec-Bench's
  (torch 2.5.1, transformers 4.37.1, 96 cores), and it is added to the roofline's time, where a
  launch-bound step overlaps the two; charging drafts by weight matrices is an assumption.
- The forecast is per decoding step: Spec-Bench's speedup is a ratio of tokens/s with prefills included,
  per question, and tau is its overall mean. The context ({CONTEXT}) does not matter: at 0 or 2048 cached
  tokens {e['sensitivity']}. KV-cache reads (about 0.27 GB at 512
  tokens, 0.13 ms on (a)) are left out of both steps alike.
- Where every forward is bound by its weight reads, the bandwidth cancels out of (a)'s speedups: the
  A100 80GB PCIe's 1935 GB/s gives the same (a) as the SXM's 2039.

## Sources, per method

{md_table(sources, ("method", "width: source", "draft: source"))}

## Provenance

Commit {commit}{' (with uncommitted changes)' if dirty else ''}; written by

    python results/reference/forecast/spec_bench_a100/spec_bench_forecast.py \\
        --out results/reference/forecast/spec_bench_a100

`forecast.csv` holds every column above and the ms behind them (ar_ms, target_ms, draft_ms per roofline).
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT), help="directory for forecast.csv and README.md")
    args = parser.parse_args(argv)
    rooflines = {label: read_roofline(path).roofline for label, path in PROFILES.items()}
    t = table(rooflines)
    commit = provenance.git_output("rev-parse", "--short", "HEAD") or "unknown"
    dirty = bool(provenance.git_output("status", "--porcelain", "--untracked-files=no"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rundir.write_atomic(out / "forecast.csv", t.to_csv(index=False, float_format="%.6g"), "give a writable directory")
    rundir.write_atomic(out / "README.md", readme(t, rooflines, commit, dirty), "give a writable directory")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(t[["method", "spec_bench_mean_accepted_tokens", "spec_bench_speedup", "forecast_a", "error_a",
                 "forecast_b", "error_b", "width", "implied_step_vs_ar", "step_vs_ar_a", "step_vs_ar_b"]]
              .round(3).to_string(index=False))
    print(f"wrote {out / 'forecast.csv'} and {out / 'README.md'}", file=sys.stderr)


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
