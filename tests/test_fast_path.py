"""The fast forward path (model.fast_path): same results as the native kernels, weights still
tied and shared, a guarded fallback when the private oneDNN ops are missing, and auto's
measured, cached choice. Speed is measured by scripts/profile_device.py, not here."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import decoders.core.fast_path as fast_path_module
import decoders.core.lm as lm_module
from bench.errors import BenchError
from bench.models import TinyRandomModel
from bench.provenance import collect
from decoders.methods.draft_model import SelfDraft
from decoders.core.fast_path import FAST_PATHS, PrepackedLinear
from decoders.core.kernels import build_id, kernel_supported
from decoders.core.lm import LM
from decoders.tuning.profile import choose_fast_path, profile_key
from helpers import tiny_lm


def _tied_model(seed=0):
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _linears(lm):
    return [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 40])
def test_prepacked_forward_matches_native(dtype, rows):
    native, fast = tiny_lm(seed=3, fast_path="none"), tiny_lm(seed=3, fast_path="prepacked")
    native.model.to(dtype), fast.model.to(dtype)
    ids = list(range(1, 11 + rows))
    a = native.forward(ids[:10], native.new_cache()), fast.forward(ids[:10], fast.new_cache())
    ca, cb = native.new_cache(), fast.new_cache()
    native.forward(ids[:10], ca), fast.forward(ids[:10], cb)
    x, y = native.forward(ids[10:], ca), fast.forward(ids[10:], cb)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(a[0].float(), a[1].float(), atol=tol, rtol=tol)
    assert torch.allclose(x.float(), y.float(), atol=tol, rtol=tol)
    assert fast.fast_path == "prepacked" and all(type(m) is PrepackedLinear for m in _linears(fast))


def test_embedding_and_head_stay_tied_and_packing_is_counted():
    lm = LM(_tied_model(), fast_path="prepacked")
    emb, head = lm.model.get_input_embeddings(), lm.model.get_output_embeddings()
    assert head.weight is emb.weight and type(head) is PrepackedLinear
    assert lm.fast_path_bytes == sum(m.weight.numel() * 4 for m in _linears(lm))
    lm.set_fast_path("none")
    assert lm.fast_path == "none" and lm.fast_path_bytes == 0
    assert all(type(m) is torch.nn.Linear and "_packed" not in m.__dict__ for m in _linears(lm))
    assert lm.model.get_output_embeddings().weight is lm.model.get_input_embeddings().weight


def test_missing_onednn_ops_fall_back_to_native(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no such op")

    import functools
    from decoders.core import fast_path
    monkeypatch.setattr(lm_module, "prepacked_supported", lm_module.prepacked_supported)  # the real probe runs
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken, raising=False)
    # the probe, uncached for this test: the process's cache keeps what the real ops do
    monkeypatch.setattr(fast_path, "linear_problem", functools.cache(fast_path.linear_problem.__wrapped__))
    lm = tiny_lm(seed=1, fast_path="prepacked")
    assert lm.fast_path == "none" and "prepacked unavailable" in lm.fast_path_note
    assert all(type(m) is torch.nn.Linear for m in _linears(lm))
    ref = tiny_lm(seed=1, fast_path="none")
    assert torch.equal(lm.forward(list(range(1, 9)), lm.new_cache()), ref.forward(list(range(1, 9)), ref.new_cache()))


def test_a_changed_weight_is_packed_again():
    lm = tiny_lm(seed=2, fast_path="prepacked")
    ids = list(range(1, 9))
    before = lm.forward(ids, lm.new_cache())
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(2.0)  # in place, as an optimizer step
    after = lm.forward(ids, lm.new_cache())
    ref = tiny_lm(seed=2, fast_path="none")
    with torch.no_grad():
        ref.model.lm_head.weight.mul_(2.0)
    assert not torch.allclose(before, after)
    assert torch.allclose(after, ref.forward(ids, ref.new_cache()), atol=1e-5)


def test_training_takes_the_native_differentiable_path():
    lm = tiny_lm(seed=2, fast_path="prepacked")
    layer = lm.model.lm_head
    x = torch.randn(5, layer.in_features, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_self_draft_shares_the_targets_path_and_packs_its_adapter():
    target = tiny_lm(seed=4, layers=3, fast_path="prepacked")
    draft = SelfDraft(layers=1).build(target)
    assert draft.fast_path == "prepacked" and draft.fast_path_bytes == 0  # shared layers: no new copies
    assert target.fast_path == "prepacked" and all(type(m) is PrepackedLinear for m in _linears(target))
    from decoders.methods.draft_model import new_exit_adapter, self_draft_model
    with_adapter = LM(self_draft_model(target.model, 1, new_exit_adapter(target.model)), fast_path=target.fast_path)
    assert type(with_adapter.model.base_model.norm[0].proj) is PrepackedLinear and with_adapter.fast_path_bytes > 0


def test_auto_measures_once_caches_and_records(tmp_path):
    lm = tiny_lm(seed=5, fast_path="none")
    choice = choose_fast_path(lm, tmp_path)
    assert choice["chosen"] in FAST_PATHS and lm.fast_path == choice["chosen"]
    assert lm.packed_min_rows == choice["min_rows"]
    assert (choice["min_rows"] is None) == (choice["chosen"] != "prepacked")
    # our kernel is a candidate where this CPU runs it (its build before, never inside, its timing)
    kernel = {"kernel"} if kernel_supported(lm.model) is None else set()
    assert set(choice["measured"]) == {"none", "prepacked>=1", "prepacked>=2", "prepacked>=4"} | kernel
    assert set(choice["unavailable"]) == {"kernel"} - kernel
    assert not kernel or choice["measured"]["kernel"]["kernel_build_s"] >= 0
    assert all(m["autoregressive_s"] > 0 and m["k16_s"] > 0 for m in choice["measured"].values())
    cached = tmp_path / "fast_path" / f"{profile_key(lm, fast_path=False)}.json"
    assert json.loads(cached.read_text())["chosen"] == choice["chosen"]
    for other, rows in [("prepacked", 2), ("none", None), ("prepacked", 1)] + [("kernel", None)] * len(kernel):
        cached.write_text(json.dumps({**choice, "chosen": other, "min_rows": rows}))
        assert choose_fast_path(lm, tmp_path)["chosen"] == other and (lm.fast_path, lm.packed_min_rows) == (other, rows)
    cached.write_text(json.dumps({"chosen": "prepacked"}))  # made before min_rows was measured: measured again
    assert "min_rows" in choose_fast_path(lm, tmp_path) and "min_rows" in json.loads(cached.read_text())
    # measured over fewer candidates (before the kernel path existed): measured again, over all of them
    cached.write_text(json.dumps({**choice, "chosen": "none", "min_rows": None,
                                  "candidates": [c for c in choice["candidates"] if c != "kernel"]}))
    assert choose_fast_path(lm, tmp_path)["candidates"] == choice["candidates"]
    assert json.loads(cached.read_text())["candidates"] == choice["candidates"]
    # measured with another build of our kernel (another source, or another CPU's flags): measured again
    stale = "decoding_bench_kernels_000000000000"
    cached.write_text(json.dumps({**choice, "chosen": "none", "min_rows": None, "kernel_build": stale}))
    choose_fast_path(lm, tmp_path)
    assert json.loads(cached.read_text())["kernel_build"] == build_id() != stale
    cached.write_text("{not json")  # damaged: measured again
    assert choose_fast_path(lm, tmp_path)["chosen"] in FAST_PATHS
    assert profile_key(lm) != profile_key(lm, fast_path=False)  # latency profiles are kept per path
    keys = {(p, m): (lm.set_fast_path(p, m), profile_key(lm))[1]
            for p, m in [("none", None), ("prepacked", 1), ("prepacked", 4), ("kernel", None)]}
    assert len(set(keys.values())) == 3 + len(kernel)  # ... and per threshold


def test_auto_times_only_the_sizes_it_weighs(monkeypatch):
    """Each candidate's cost times the 1-token step and forwards of CHOICE_SIZES tokens, no other
    width (a third of the whole curve's forwards), and its figures never fall with k."""
    from decoders.tuning import profile

    timed, real = [], profile.timed_forward
    monkeypatch.setattr(profile, "timed_forward", lambda lm, ids, cache, context, k: timed.append(k) or
                        {0: 3e-3, 2: 5e-3, 4: 4e-3}.get(k, 6e-3) + 0 * real(lm, ids, cache, context, k))
    costs = profile.step_costs(tiny_lm(seed=5))
    assert set(timed) == {0, 1, *profile.CHOICE_SIZES} and timed.count(1) == 1  # 1: a warm-up only
    assert costs == {"autoregressive_s": 3e-3, "k2_s": 5e-3, "k4_s": 5e-3, "k8_s": 6e-3, "k16_s": 6e-3}


def test_a_thresholded_path_keeps_each_kernels_own_curve(monkeypatch):
    """prepacked>=2 runs the native kernel at 1 row (38 ms here) and the packed one from 2 rows (22 ms, then
    rising): the profile is non-decreasing on each kernel, and no size past the switch inherits the native
    kernel's 38 ms. A noisy dip on one kernel is still levelled."""
    from decoders.tuning import profile

    native, packed = {0: 37e-3, 1: 38e-3}, {2: 22e-3, 3: 25e-3, 4: 24e-3, 5: 26e-3}
    rounds = {k: [t, 2 * t] for k, t in {**native, **packed}.items()}  # the fastest round counts
    monkeypatch.setattr(profile, "forward_samples", lambda lm, top, context, repeats: rounds)
    lm = tiny_lm(seed=5, fast_path="prepacked")
    lm.set_fast_path("prepacked", 2)
    assert profile.kernel_switches(lm) == (2,)
    curve, step = profile.measure_forward_latency(lm, max_tokens=5)
    assert curve == [38e-3, 22e-3, 25e-3, 25e-3, 26e-3] and step == 37e-3
    lm.set_fast_path("none")
    assert profile.kernel_switches(lm) == () and profile.measure_forward_latency(lm, 5)[0][1:] == [38e-3] * 4


def test_a_cached_profile_without_its_kernel_switches_is_measured_again(tmp_path, monkeypatch):
    from decoders.tuning import profile

    lm = tiny_lm(seed=5, fast_path="prepacked")
    lm.set_fast_path("prepacked", 2)
    measured = []
    monkeypatch.setattr(profile, "measure_forward_latency",
                        lambda lm, k, context, repeats: measured.append(k) or ([1e-3] * k, 1e-3))
    first = profile.forward_latency(lm, tmp_path, max_tokens=4)
    assert first["kernel_switches"] == [2] and profile.forward_latency(lm, tmp_path, max_tokens=4) == first
    path = tmp_path / "latency" / f"{first['key']}.json"
    path.write_text(json.dumps({k: v for k, v in first.items() if k != "kernel_switches"}))
    profile.forward_latency(lm, tmp_path, max_tokens=4)
    assert measured == [4, 4]


@pytest.mark.parametrize("min_rows", [1, 2, 4, 8])
def test_packed_kernel_runs_from_min_rows_up(monkeypatch, min_rows):
    lm = tiny_lm(seed=7, fast_path="prepacked")
    assert lm.packed_min_rows == fast_path_module.PACKED_MIN_ROWS[torch.float32]  # the default
    assert lm.set_fast_path("prepacked", min_rows) == "prepacked" and lm.packed_min_rows == min_rows
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(len(x)) or real(x, *a))
    ref = tiny_lm(seed=7, fast_path="none")
    for rows in (1, 2, 3, 4, 8):
        calls.clear()
        ids = list(range(1, 1 + rows))
        out = lm.forward(ids, lm.new_cache())
        assert bool(calls) == (rows >= min_rows), (rows, calls)
        assert torch.allclose(out, ref.forward(ids, ref.new_cache()), atol=1e-5)
    heads = lm.accelerate(torch.nn.Linear(4, 4))  # an add-on joins at the same threshold
    assert type(heads) is PrepackedLinear and heads._min_rows == min_rows
    draft = SelfDraft(layers=1).build(lm)  # a self-draft shares the layers and their threshold
    assert draft.packed_min_rows == min_rows
    with pytest.raises(ValueError, match="min_rows must be an integer >= 1"):
        lm.set_fast_path("prepacked", 0)
    lm.set_fast_path("none")
    assert lm.packed_min_rows is None and all(type(m) is torch.nn.Linear for m in _linears(lm))


def test_model_config_key_and_provenance(tmp_path):
    spec = TinyRandomModel(device="cpu", dtype="float32", fast_path="prepacked", cache_dir=str(tmp_path), vocab_size=64)
    lm = spec.load()
    record = collect(lm)
    assert record["fast_path"] == "prepacked" and record["fast_path_extra_bytes"] > 0 and record["packed_min_rows"] == 4
    auto = TinyRandomModel(device="cpu", dtype="float32", fast_path="auto", cache_dir=str(tmp_path),
                           vocab_size=64).load()
    assert auto.fast_path_note.startswith(f"auto chose {auto.fast_path}")
    with pytest.raises(BenchError, match="model.fast_path='fast' is not allowed; use auto, none, prepacked"):
        TinyRandomModel(device="cpu", fast_path="fast").load()


def test_a_model_built_under_inference_mode_is_packed():
    with torch.inference_mode():  # e.g. a draft model loaded while the runner prepares a decoder
        lm = tiny_lm(seed=6, fast_path="prepacked")
        assert lm.fast_path == "prepacked"
        out = lm.forward(list(range(1, 9)), lm.new_cache())
    ref = tiny_lm(seed=6, fast_path="none")
    assert torch.allclose(out, ref.forward(list(range(1, 9)), ref.new_cache()), atol=1e-5)
