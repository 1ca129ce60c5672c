"""model.fast_path=kernel (decoders/core/kernels.py): the kernel against F.linear, each row's result
bitwise the same alone or among others, the module swap (tying, repacking, switching paths), the
fallback in one line where the kernel cannot run, and decoders through the path: float32
token-identical to autoregressive through the same path, bfloat16 up to ties. Speed is measured by
scripts/profile_device.py and scripts/bench_linear_kernels.py, not here. The extension is built before
the session (tests/conftest.py); where it cannot build these tests skip, saying why."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import decoders.core.kernels as kernels
from bench.runner import judge_lossless
from decoders.core.lm import LM
from decoders.core.sampling import ArgmaxRows, NonFiniteLogits, PanelMaxima, Sampling, argmax, top_k_rows
from decoders.methods.autoregressive import autoregressive_decode
from helpers import first_quick, tiny_lm
from test_fast_path import _linears, _tied_model
from test_greedy_equality import DECODERS as ALL_DECODERS, check_trace, tiny_case

WHY_NOT = {dtype: kernels.dtype_supported(dtype) for dtype in (torch.float32, torch.bfloat16)}
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(WHY_NOT[dtype] is not None, reason=f"kernel: {WHY_NOT[dtype]}"),
                       id=str(dtype).replace("torch.", "")) for dtype in WHY_NOT]
# Every test but the failed build's runs the kernel: skipped, saying why, where this machine cannot.
needs_kernel = pytest.mark.skipif(WHY_NOT[torch.float32] is not None, reason=f"kernel: {WHY_NOT[torch.float32]}")
ROWS = [1, 2, 3, 5, 8, 9, 16, 31, 32, 64]
GREEDY = Sampling()


def _within_bound(out, x, w, b):
    """|out - exact| within the float32 summation bound (K + 2) u sum |x_i w_i| (u = 2^-24), plus, in
    bfloat16, the output's own rounding (2^-8 of it): the bound a sum in any order meets."""
    x, w = x.double(), w.double()
    exact = F.linear(x, w, b.double() if b is not None else None)
    magnitude = F.linear(x.abs(), w.abs(), b.double().abs() if b is not None else None)
    bound = (x.shape[-1] + 2) * 2.0 ** -24 * magnitude
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    return bool(((out.double() - exact).abs() <= bound + 1e-30).all())


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(70, 37), (33, 64), (96, 576), (5, 1)])  # n not a multiple of 32; odd k
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_f_linear(dtype, n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    packed = kernels.pack(w)
    for m in ROWS:
        x = torch.randn(m, k, generator=g).to(dtype)
        out = kernels.linear(x, packed, b, n)
        native = F.linear(x, w, b)
        assert out.shape == native.shape == (m, n) and out.dtype == dtype
        assert _within_bound(out, x, w, b), m
        assert _within_bound(native, x, w, b)  # the bound the native kernel meets too
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out.float(), native.float(), rtol=tol, atol=tol * float(native.abs().max())), m
    x3 = torch.randn(2, 3, k, generator=g).to(dtype)  # (batch, tokens, k) as a model feeds it
    flat = kernels.linear(x3.reshape(6, k), packed, b, n)
    assert torch.equal(kernels.linear(x3, packed, b, n), flat.reshape(2, 3, n))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_bitwise_the_same_alone_or_among_others(dtype):
    """Each output is summed over k in one order whatever the rows: a tree's verification of 32 tokens
    gives each row the bits a one-token step gives it (the linears; attention is another matter)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(100, 576, generator=g).to(dtype), torch.randn(100, generator=g).to(dtype)
    packed = kernels.pack(w)
    x = torch.randn(64, 576, generator=g).to(dtype)
    full = kernels.linear(x, packed, b, 100)
    for m in ROWS:
        assert torch.equal(kernels.linear(x[:m], packed, b, 100), full[:m]), m
    for r in range(0, 64, 7):
        assert torch.equal(kernels.linear(x[r:r + 1], packed, b, 100), full[r:r + 1]), r
        assert torch.equal(kernels.linear(x[r:r + 9], packed, b, 100)[0], full[r]), r


def _crafted_rows(dtype):
    """(rows, n) outputs the kernel computes exactly (W the identity, no bias): n = 100, three panels of 32
    and four columns, with the ties and places numpy's argmax resolves in order."""
    n = 100
    x = torch.randn(6, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[1, 5] = x[1, 70] = 9  # a tie across panels: the first
    x[2, 40] = x[2, 41] = 9  # a tie inside a panel: the first
    x[3, 98] = 9  # in the partial last panel
    x[4] = 1  # a constant row: 0
    x[5] = -x[5].abs() - 1
    x[5, 33] = -0.5  # every value negative
    return x, torch.eye(n, dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_readout_panel_maxima_give_numpys_argmax(dtype):
    """linear(best=True): each row's panel maxima, from which argmax is numpy's argmax of the row (first
    largest, first NaN), ties across and inside panels, a partial panel, NaN and inf included."""
    x, w = _crafted_rows(dtype)
    n = w.shape[0]
    out, values, where = kernels.linear(x, kernels.pack(w), None, n, best=True)
    assert torch.equal(out, x) and values.shape == where.shape == (6, 4)
    maxima = PanelMaxima(values, where, kernels.extension().panel)
    expected = out.float().numpy().argmax(-1).tolist()
    assert expected[1:] == [5, 40, 98, 0, 33]
    assert argmax(out, maxima) == expected
    assert argmax(torch.zeros_like(out), maxima) == expected  # the maxima alone decide: the row is not read
    assert [argmax(out[i], maxima[i]) for i in range(6)] == expected
    wrong = PanelMaxima(values, torch.zeros_like(where), maxima.panel)  # negative control: columns lost
    assert argmax(out, wrong) != expected
    for bias, index in [({50: "nan", 80: "nan"}, 50), ({60: "inf"}, 60), ({10: "inf", 90: "nan"}, 90),
                        ({3: "inf", 7: "nan"}, 7)]:
        b = torch.zeros(n, dtype=dtype)
        for column, value in bias.items():
            b[column] = float(value)
        out, values, where = kernels.linear(x[:1], kernels.pack(w), b, n, best=True)
        assert out.float().numpy().argmax(-1).tolist() == [index]
        with pytest.raises(NonFiniteLogits):
            argmax(out, PanelMaxima(values, where, maxima.panel))
        assert int(where[0, index // maxima.panel]) == index % maxima.panel
    out, values, where = kernels.linear(x[:1], kernels.pack(w), torch.full((n,), float("-inf"), dtype=dtype), n,
                                        best=True)
    with pytest.raises(NonFiniteLogits):  # a row all -inf
        argmax(out, PanelMaxima(values, where, maxima.panel))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_from_panel_maxima_is_torchs_topk(dtype):
    g = torch.Generator().manual_seed(2)
    n, k = 8192, 64
    w = torch.randn(n, k, generator=g).to(dtype)
    w[4000] = w[17]  # equal logits in two panels
    x = torch.randn(3, k, generator=g).to(dtype)
    out, values, where = kernels.linear(x, kernels.pack(w), None, n, best=True)
    maxima = PanelMaxima(values, where, kernels.extension().panel)
    for top in (1, 8, 16):
        ids = top_k_rows(out, top, maxima)
        assert torch.equal(out.gather(1, ids), torch.topk(out, top).values), top
    rows = ArgmaxRows(out, top_k=8, maxima=maxima)
    assert rows.slice() == [rows[i] for i in range(3)] == out.float().numpy().argmax(-1).tolist()
    assert rows.slice(1, 3) == rows.slice()[1:3] and rows.slice(2) == rows.slice()[2:]


def _maxima_of(rows: torch.Tensor, panel: int) -> PanelMaxima:
    """rows' panel maxima as the readout writes them (a partial last panel padded with -inf; a NaN wins)."""
    n, V = rows.shape
    padded = torch.full((n, -(-V // panel) * panel), float("-inf"))
    padded[:, :V] = rows.float()
    values = padded.reshape(n, -1, panel).amax(-1)
    return PanelMaxima(values, torch.zeros(values.shape, dtype=torch.int32), panel)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["random", "one_panel", "ties", "all_-inf", "partial_panel"])
def test_the_librarys_top_k_is_torchs_topk(dtype, case):
    """kernels.cpp top_k (each row's k largest from its panel maxima, in one call): torch.topk's values in
    its order, distinct ids, on 262,144-token rows: random, the top k all in one panel, ties everywhere,
    rows all -inf, and a vocabulary whose last panel is partial with the largest values in it."""
    library = kernels.extension()
    g = torch.Generator().manual_seed(5)
    V = 1000 if case == "partial_panel" else 262_144
    rows = torch.randn(7, V, generator=g)
    if case == "one_panel":
        rows[:, 1024:1088] = 10 + torch.arange(64.0)  # two panels hold the top 64
        rows[:, 1030:1038] = 100 + torch.arange(8.0)
    if case == "ties":
        rows = torch.randint(0, 3, (7, V), generator=g).float()
    if case == "all_-inf":
        rows[:] = float("-inf")
    if case == "partial_panel":
        rows[:, V - 3:] = 50 + torch.arange(3.0)
    rows = rows.to(dtype)
    maxima = _maxima_of(rows, library.panel)
    for k in (1, 8, 16 if case == "partial_panel" else 64):  # 1000 tokens: 32 panels
        ids = library.top_k(rows, maxima.values, maxima.panel, k)
        assert ids is not None and ids.shape == (7, k)
        assert torch.equal(rows.gather(1, ids), torch.topk(rows, k).values), k
        assert all(len(set(r)) == k for r in ids.tolist())
        assert torch.equal(top_k_rows(rows, k, maxima), ids)
    assert torch.equal(library.top_k(rows[2:5], maxima.values[2:5], maxima.panel, 8), library.top_k(
        rows, maxima.values, maxima.panel, 8)[2:5])  # a row's answer does not depend on the others
    if case == "random":  # negative control: maxima of other rows point to the wrong panels
        wrong = library.top_k(rows, maxima.values.roll(1, 0), maxima.panel, 8)
        assert not torch.equal(rows.gather(1, wrong), torch.topk(rows, 8).values)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_row_is_left_to_torch_topk(dtype):
    """A row holding a NaN: the library does not answer (torch.topk's order of NaNs decides) and
    top_k_rows gives torch.topk's answer, NaN first."""
    rows = torch.randn(3, 8192, generator=torch.Generator().manual_seed(6)).to(dtype)
    rows[1, 5000] = float("nan")
    maxima = _maxima_of(rows, kernels.extension().panel)
    assert kernels.extension().top_k(rows, maxima.values, maxima.panel, 8) is None
    ids = top_k_rows(rows, 8, maxima)
    expected = torch.topk(rows, 8).values
    assert torch.allclose(rows.gather(1, ids).float(), expected.float(), equal_nan=True)
    assert int(ids[1, 0]) == 5000


@needs_kernel
def test_the_model_readout_keeps_its_panel_maxima_on_the_kernel_path_only():
    """LM.maxima_of: the maxima of the logits the last forward returned, that very tensor only (logits a
    caller replaced, e.g. with NaN, are read themselves); none off the kernel path or past its rows."""
    fast, native = tiny_lm(seed=3, fast_path="kernel"), tiny_lm(seed=3, fast_path="none")
    ids = [(7 * i + 3) % 64 for i in range(kernels.MAX_ROWS + 4)]
    cache = fast.new_cache()
    logits = fast.forward(ids[:kernels.MAX_ROWS + 1], cache)  # past the kernel's rows: the native readout
    assert fast.maxima_of(logits) is None
    logits = fast.forward(ids[kernels.MAX_ROWS + 1:], cache)
    maxima = fast.maxima_of(logits)
    assert maxima is not None and argmax(logits, maxima) == argmax(logits)
    assert fast.maxima_of(logits.clone()) is None and fast.maxima_of(logits[1:]) is None
    logits = native.forward(ids[:5], native.new_cache())
    assert native.maxima_of(logits) is None
    fast.set_fast_path("none")
    logits = fast.forward(ids[:5], fast.new_cache())
    assert fast.maxima_of(logits) is None and "keeps_maxima" not in fast.head.__dict__


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_the_native_path(dtype):
    """The model's logits through the kernel path against the native path's, at the dtype's tolerance:
    a prompt past MAX_ROWS (native), then widths the kernel takes."""
    native, fast = tiny_lm(seed=3, fast_path="none"), tiny_lm(seed=3, fast_path="kernel")
    native.model.to(dtype), fast.model.to(dtype)
    assert fast.fast_path == "kernel" and all(type(m) is kernels.KernelLinear for m in _linears(fast))
    ids = [(7 * i + 3) % 64 for i in range(kernels.MAX_ROWS + 40)]
    caches = native.new_cache(), fast.new_cache()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    for start, end in [(0, kernels.MAX_ROWS + 6), (kernels.MAX_ROWS + 6, kernels.MAX_ROWS + 7),
                       (kernels.MAX_ROWS + 7, kernels.MAX_ROWS + 40)]:
        a, b = (lm.forward(ids[start:end], c) for lm, c in zip((native, fast), caches))
        assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (start, end)


@pytest.mark.slow
@needs_kernel
def test_using_sends_the_calls_to_another_build_and_gives_the_process_its_own_back(tmp_path):
    """kernels.using, the A/B of scripts/bench_linear_kernels.py --forward: inside it the model runs on the
    other build (here the one without chunks of K: the same bits, every output summed in one order); after
    it, even after an error, on the process's own; a build of other panels is refused."""
    from types import SimpleNamespace

    from helpers import script_module
    forward_table, variant = (getattr(script_module("scripts/bench_linear_kernels.py"), f)
                              for f in ("forward_table", "variant"))

    own, other = kernels.extension(), variant("-DDB_KCHUNK=0", tmp_path)
    lm = tiny_lm(seed=3, fast_path="kernel")  # hidden 64: two chunks of 32 where the rows take several blocks
    ids = [(7 * i + 3) % 64 for i in range(30)]
    with kernels.using(other):
        assert kernels._lib is other
        theirs = lm.forward(ids, lm.new_cache())
    assert kernels._lib is own
    assert torch.equal(lm.forward(ids, lm.new_cache()), theirs)
    with pytest.raises(KeyError), kernels.using(other):
        raise KeyError("inside")
    assert kernels._lib is own
    with pytest.raises(ValueError, match="panels"), kernels.using(SimpleNamespace(panel=own.panel * 2, path=tmp_path)):
        pass
    table = forward_table(lm, {"own": own, "other": other}, [2, 8], repeats=1, context=8)
    assert sorted(zip(table.kernel, table.tokens)) == sorted((k, t) for k in ("own", "other") for t in (0, 2, 8))
    assert kernels._lib is own


@needs_kernel
def test_the_swap_keeps_tied_weights_and_repacks_a_changed_weight():
    lm = LM(_tied_model(), fast_path="kernel")
    emb, head = lm.model.get_input_embeddings(), lm.model.get_output_embeddings()
    assert head.weight is emb.weight and type(head) is kernels.KernelLinear
    assert lm.fast_path_bytes >= sum(m.weight.numel() * 4 for m in _linears(lm))  # padded panels
    ids = [1, 2, 3]
    before = lm.forward(ids, lm.new_cache())
    with torch.no_grad():
        emb.weight.mul_(2)  # the tied head changes in place: its packed copy is rebuilt
    after = lm.forward(ids, lm.new_cache())
    ref = LM(_tied_model(), fast_path="none")
    with torch.no_grad():
        ref.model.get_input_embeddings().weight.mul_(2)
    assert not torch.allclose(before, after)
    assert torch.allclose(after, ref.forward(ids, ref.new_cache()), atol=1e-5)
    heads = lm.accelerate(torch.nn.Linear(4, 4))  # an add-on joins the path
    assert type(heads) is kernels.KernelLinear
    assert lm.set_fast_path("prepacked") == "prepacked"  # one path at a time
    assert not any(type(m) is kernels.KernelLinear for m in lm.model.modules())
    assert lm.set_fast_path("kernel") == "kernel" and lm.packed_min_rows is None
    assert not any(type(m).__name__ == "PrepackedLinear" for m in lm.model.modules())
    lm.set_fast_path("none")
    assert lm.fast_path == "none" and lm.fast_path_bytes == 0
    assert all(type(m) is torch.nn.Linear and "_kernel_packed" not in m.__dict__ for m in _linears(lm))
    assert lm.model.get_output_embeddings().weight is lm.model.get_input_embeddings().weight


@needs_kernel
def test_autograd_and_other_dtypes_keep_the_native_kernel():
    lm = tiny_lm(seed=1, fast_path="kernel")
    layer = lm.model.lm_head
    x = torch.randn(3, layer.in_features, requires_grad=True)
    layer(x).sum().backward()  # autograd: F.linear, so gradients flow
    assert x.grad is not None and x.grad.abs().sum() > 0
    half = torch.nn.Linear(8, 4).half()
    assert type(lm.accelerate(half)) is torch.nn.Linear  # float16: not the kernel's, left native


# ---- the fused RMSNorm (KernelRMSNorm) ------------------------------------------------------------------
def _llama_norm(dim: int, dtype: torch.dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(dim, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(1)))
    return norm


def _fused(norm):
    """The same module on the kernel path (a copy: the class is swapped in place)."""
    fused = copy.deepcopy(norm)
    kernels._DTYPES.add(next(fused.parameters()).dtype)
    fused.__class__ = kernels._kernel_norm_class(type(norm))
    return fused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 100, 7])  # SmolLM2's; a tail of 4 lanes; under one vector
def test_fused_norm_matches_transformers_and_each_row_is_its_own(dtype, dim):
    norm = _llama_norm(dim, dtype)
    fused = _fused(norm)
    x = (torch.randn(2, 33, dim, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    with torch.inference_mode():
        want, got = norm(x), fused(x)
        alone = [fused(x[0, r:r + 1]) for r in (0, 17, 32)]
        strided = fused(x.transpose(0, 1))  # not contiguous: copied first
    ulp = torch.finfo(dtype).eps
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.allclose(got.float(), want.float(), rtol=2 * ulp, atol=1e-6)
    assert all(torch.equal(a[0], got[0, r]) for a, r in zip(alone, (0, 17, 32)))
    assert torch.equal(strided, got.transpose(0, 1))
    if dtype == torch.float32:  # the control: a wrong eps is seen
        fused.variance_epsilon = 1.0
        assert not torch.allclose(fused(x), want, rtol=2 * ulp, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [640, 256, 7])  # Gemma 3 270M's width and head; under one vector
def test_gemmas_norm_is_fused_and_matches_transformers(dtype, dim, monkeypatch):
    """Gemma's RMSNorm, (1 + w) * (x * rsqrt(mean(x^2) + eps)) in float32 and rounded once: fused on the
    kernel path in each dtype the kernel runs, its weight offset made once per weight version."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    monkeypatch.setattr(kernels, "_NORMS", {})  # probed afresh, in every dtype this machine's kernel runs
    monkeypatch.setattr(kernels, "_DTYPES", {d for d, why in WHY_NOT.items() if why is None})
    norm = Gemma3RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(1)))
    norm = norm.to(dtype)
    fused = _fused(norm)
    assert isinstance(fused, kernels.KernelRMSNorm) and fused.kernel_dtypes == kernels._DTYPES
    x = (torch.randn(2, 33, dim, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    close = dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    with torch.inference_mode():
        want, got = norm(x), fused(x)
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **close)
        assert torch.equal(fused(x[1:, 5:9]), got[1:, 5:9])  # each row on its own
    with torch.no_grad():  # a new weight: its offset is made again
        norm.weight.add_(0.5)
        fused.weight.add_(0.5)
    with torch.inference_mode():
        assert torch.allclose(fused(x).float(), norm(x).float(), **close)
        fused.eps = 1.0  # the control: a wrong eps is seen
        assert not torch.allclose(fused(x).float(), norm(x).float(), **close)


@needs_kernel
def test_only_known_norm_formulas_are_fused_and_the_swap_is_undone():
    class CenteredRMSNorm(torch.nn.Module):  # subtracts the mean: neither Llama's formula nor Gemma's
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.weight, self.variance_epsilon, self.eps = torch.nn.Parameter(torch.zeros(dim)), eps, eps

        def forward(self, x):
            x32 = x.float() - x.float().mean(-1, keepdim=True)
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
                    * (1.0 + self.weight.float())).to(x.dtype)

    lm = tiny_lm(seed=1, fast_path="kernel")
    norms = [m for m in lm.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(isinstance(m, kernels.KernelRMSNorm) for m in norms)
    other = torch.nn.Sequential(CenteredRMSNorm(16))
    lm.accelerate(other)
    assert type(other[0]) is CenteredRMSNorm
    x = torch.randn(3, norms[0].weight.shape[0], requires_grad=True)
    norms[0](x).sum().backward()  # autograd: transformers' own forward, so gradients flow
    assert x.grad is not None and x.grad.abs().sum() > 0
    lm.set_fast_path("none")
    assert all(type(m).__name__ == "LlamaRMSNorm" for m in norms)


# ---- the fused rotary embeddings (KernelAttention) ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv, tokens, dim", [(9, 3, 1, 64), (9, 3, 17, 64), (4, 2, 5, 36), (2, 1, 3, 8)])
def test_fused_rotary_is_bitwise_transformers(dtype, heads, kv, tokens, dim):
    from transformers.models.llama import modeling_llama
    lm = tiny_lm(seed=1, fast_path="kernel")  # installs the dispatcher
    kernels._DTYPES.add(dtype)  # as a model in this dtype on the path would
    original = modeling_llama.apply_rotary_pos_emb.original
    gen = torch.Generator().manual_seed(heads * tokens)
    q = (torch.randn(2, tokens, heads, dim, generator=gen) * 3).to(dtype).transpose(1, 2)  # as attention makes it
    k = (torch.randn(2, tokens, kv, dim, generator=gen) * 3).to(dtype).transpose(1, 2)
    angle = torch.randn(2, tokens, dim, generator=gen) * 20
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    want = original(q, k, cos, sin)
    calls = []
    real = dict(kernels._lib.rotary)
    kernels._lib.rotary = {d: (lambda *a, f=f: (calls.append(1), f(*a))[1]) for d, f in real.items()}
    try:
        outside = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)  # not inside attention: transformers'
        assert calls == []
        kernels._in_kernel_attention.on = True
        got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    finally:
        kernels._in_kernel_attention.on = False
        kernels._lib.rotary = real
    assert calls == [1]
    for g, w, o in zip(got, want, outside):
        assert torch.equal(g, w) and torch.equal(o, w)
        def layout(t):
            return [st for st, n in zip(t.stride(), t.shape) if n > 1]  # a size-1 dimension's stride is moot
        assert layout(g) == layout(w)
        assert torch.equal(torch.signbit(g), torch.signbit(w))  # zeros keep their sign, as torch's neg gives it
    assert any(isinstance(m, kernels.KernelAttention) for m in lm.model.modules())


@needs_kernel
def test_a_rotary_of_another_formula_is_refused_and_the_swap_is_undone(monkeypatch):
    import sys
    import types

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):  # GPT-J's pairs, not Llama's halves
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    fake = types.ModuleType("fake_gptj_modeling")
    fake.apply_rotary_pos_emb = interleaved

    class FakeAttention(torch.nn.Module):
        __module__ = "fake_gptj_modeling"

        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    monkeypatch.setitem(sys.modules, "fake_gptj_modeling", fake)
    lm = tiny_lm(seed=1, fast_path="kernel")
    attention = lm.accelerate(torch.nn.Sequential(FakeAttention()))[0]
    assert type(attention) is FakeAttention and fake.apply_rotary_pos_emb is interleaved
    assert kernels._ROTARY.pop("fake_gptj_modeling") is False
    llama = [m for m in lm.model.modules() if type(m).__name__.endswith("LlamaAttention")]
    assert llama and all(isinstance(m, kernels.KernelAttention) for m in llama)
    lm.set_fast_path("none")
    assert all(type(m).__name__ == "LlamaAttention" for m in llama)


def _fresh_build_state(monkeypatch):
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_why_not", None)
    monkeypatch.setattr(kernels, "_DTYPES", set())


def test_a_failed_build_falls_back_in_one_line(monkeypatch):
    _fresh_build_state(monkeypatch)

    def no_compiler(built_for):
        raise RuntimeError("Ninja is required to load C++ extensions (pip install ninja to get it)\nmore lines")

    monkeypatch.setattr(kernels, "_build", no_compiler)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: set(kernels.NEEDED_FLAGS[torch.float32]))  # any machine
    lm = tiny_lm(seed=1, fast_path="kernel")
    assert lm.fast_path == "none" and "\n" not in lm.fast_path_note
    assert lm.fast_path_note == ("kernel unavailable: the kernel extension did not build or load (RuntimeError: "
                                 "Ninja is required to load C++ extensions (pip install ninja to get it))")
    ref = tiny_lm(seed=1, fast_path="none")
    ids = [1, 2, 3, 4]
    assert torch.equal(lm.forward(ids, lm.new_cache()), ref.forward(ids, ref.new_cache()))


def test_a_run_says_in_one_line_which_path_it_takes_instead(monkeypatch, capsys):
    """model.fast_path=kernel (or model.compile=inductor) on a machine without it: the run goes on natively
    and says so in one line on stderr; a path that runs says nothing."""
    from bench.models import put_on_fast_path
    _fresh_build_state(monkeypatch)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse4_2"})
    lm = put_on_fast_path(tiny_lm(seed=1, fast_path="none"), "kernel", None)
    err = capsys.readouterr().err
    assert lm.fast_path == "none" and err.count("\n") == 1
    assert err.startswith("warning: model.fast_path=kernel runs none here: kernel unavailable: this CPU lacks "
                          "avx2, fma")
    put_on_fast_path(tiny_lm(seed=1, fast_path="none"), "none", None)
    assert capsys.readouterr().err == ""


@needs_kernel
def test_missing_instructions_fall_back_in_one_line(monkeypatch):
    """This CPU's instructions less some (never more: a library built for more would not run here)."""
    real = kernels.cpu_flags()
    if kernels.isa() == "avx512":
        _fresh_build_state(monkeypatch)
        monkeypatch.setattr(kernels, "cpu_flags", lambda: real - {"avx512_bf16"})
        bf16 = tiny_lm(seed=1, fast_path="kernel", dtype="bfloat16")
        assert bf16.fast_path == "none"
        assert bf16.fast_path_note == "kernel unavailable: this CPU lacks avx512_bf16 (the bfloat16 kernel needs it)"
        assert tiny_lm(seed=1, fast_path="kernel").fast_path == "kernel"  # float32 runs without it
    _fresh_build_state(monkeypatch)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {f for f in real if not f.startswith("avx512")})  # AVX2's
    assert tiny_lm(seed=1, fast_path="kernel").fast_path == "kernel"  # float32, in the AVX2 build
    bf16 = tiny_lm(seed=1, fast_path="kernel", dtype="bfloat16")
    assert bf16.fast_path == "none" and bf16.fast_path_note == (
        "kernel unavailable: this CPU lacks avx512f, avx512bw, avx512dq, avx512vl, avx512_bf16 (the bfloat16 "
        "kernel needs it)")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse4_2"})  # neither AVX-512 nor AVX2
    lm = tiny_lm(seed=1, fast_path="kernel")
    assert lm.fast_path == "none" and lm.fast_path_note == ("kernel unavailable: this CPU lacks avx2, fma (the kernel "
                                                            "path needs AVX-512, or AVX2 with FMA)")
    fp16 = tiny_lm(seed=1, fast_path="kernel", dtype="float16")
    assert fp16.fast_path_note == "kernel unavailable: the kernel path supports float32 and bfloat16, not float16"
    meta = _tied_model().to("meta")
    assert kernels.kernel_supported(meta) == "the kernel path is CPU only; this model is on meta"


@needs_kernel
def test_the_op_traces_for_torch_compile():
    """model.compile traces KernelLinear into an opaque op with a fake (shape-only) version; inductor's
    own compile is tested in test_compile.py's way (slow), here dynamo and AOT autograd only."""
    lm = tiny_lm(seed=2, fast_path="kernel")
    layer = lm.model.lm_head
    x = torch.randn(1, 5, layer.in_features)
    with torch.inference_mode():
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
        assert torch.equal(compiled(x), layer(x))
        assert torch.equal(compiled(x[:, :3]), layer(x[:, :3]))


@needs_kernel
@pytest.mark.slow
def test_compiled_forward_on_the_kernel_path_equals_eager():
    """model.compile=inductor over the kernel path: the graph calls the kernel (an opaque op) and
    returns what the eager kernel path does, across widths (inductor starts a compiler: slow)."""
    eager, compiled = tiny_lm(seed=0, fast_path="kernel"), tiny_lm(seed=0, fast_path="kernel")
    assert compiled.set_compile("inductor") == "inductor" and compiled.fast_path == "kernel"
    prompt = [3, 9, 4, 1, 7, 2, 11]
    caches = eager.new_cache(), compiled.new_cache()
    for ids in (prompt, [5], [6, 7, 8], [(5 * i + 1) % 64 for i in range(17)]):
        a, b = (lm.forward(ids, c) for lm, c in zip((eager, compiled), caches))
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), len(ids)


# ---- decoders through the path ---------------------------------------------------------------------
# A chain copied from the text, a window and n-gram pool, a tree from a random feature draft.
DECODERS = {label: ALL_DECODERS[label] for label in ("prompt_lookup", "lookahead", "eagle-dynamic-10-3-4-seed1")}


@needs_kernel
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("seed", first_quick(range(2)))
def test_greedy_equality_float32(decoder, seed):
    """Token-identical to autoregressive through the same path (float32)."""
    lm = tiny_lm(seed=seed, fast_path="kernel")
    assert lm.fast_path == "kernel"
    for kind in ("random", "repetitive"):
        prompt = tiny_case(seed, kind)
        reference = autoregressive_decode(lm, prompt, 40, GREEDY, stop_ids=set())
        out = DECODERS[decoder].generate(lm, prompt, 40, GREEDY, set())
        assert out.tokens == reference.tokens, (decoder, kind)
        check_trace(out, 40, set())


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("decoder", DECODERS)
def test_greedy_equality_bfloat16_up_to_ties(decoder, dtype):
    lm = tiny_lm(seed=2, fast_path="kernel", dtype="bfloat16")
    assert lm.fast_path == "kernel"
    prompt = tiny_case(2, "repetitive")
    reference = autoregressive_decode(lm, prompt, 20, GREEDY, stop_ids=set())
    out = DECODERS[decoder].generate(lm, prompt, 20, GREEDY, set())
    check_trace(out, 20, set())
    verdict = judge_lossless(lm, prompt, out.tokens, reference.tokens)
    assert verdict["first_real_divergence"] is None, verdict
