"""Device and dtype placement, GPU sync, the load-time memory and placement checks, and the
hardware provenance records. This machine has no GPU: placement is checked by construction (a
head moved to the meta device stands for a model whose device_map ends on another GPU), CUDA
queries are monkeypatched, and the end-to-end GPU equality runs under the `cuda` marker."""
import functools
import types

import pytest
import torch

from bench import provenance
from bench.errors import BenchError
from bench.models import (PretrainedModel, TinyRandomModel, check_memory, check_placement, kv_cache_bytes,
                          step_bytes, weight_bytes)
from decoders.core.lm import LM
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.bpd import BPD
from decoders.methods.draft_model import SelfDraft, new_exit_adapter
from decoders.methods.eagle import Eagle
from decoders.methods.eagle_draft import new_draft
from decoders.methods.heads import new_heads
from decoders.methods.medusa import Medusa
from decoders.methods.sequoia import Sequoia
from decoders.methods.spec_chain import SpecChain
from helpers import tiny_lm


def split_lm(dtype=torch.bfloat16) -> LM:
    """A tiny LM whose head sits on another device than its input (meta here): what a device_map
    spreading the layers over GPUs makes."""
    spec = TinyRandomModel(num_layers=2, seed=0, device="cpu", dtype="float32")
    model = spec.build(64).to(dtype)
    model.lm_head.to("meta")
    return LM(model)


def test_lm_reports_input_and_output_devices():
    lm = split_lm()
    assert lm.device == torch.device("cpu") and lm.output_device == torch.device("meta")
    assert lm.dtype == torch.bfloat16 and lm.cuda_devices == []
    assert lm.device_map()["meta"] == 1 and lm.device_map()["cpu"] > 1


def test_addons_sit_where_their_input_comes_out_in_the_target_dtype():
    """Heads and the EAGLE draft read the last hidden state / features and share the head: the
    output device. The exit adapter reads layer k's output: that layer's device."""
    lm = split_lm()
    for addon in (new_heads(lm, 2), new_draft(lm)):
        assert {(p.device.type, p.dtype) for p in addon.parameters()} == {("meta", torch.bfloat16)}
    adapter = new_exit_adapter(lm.model, 1)
    assert {(p.device.type, p.dtype) for p in adapter.parameters()} == {("cpu", torch.bfloat16)}


def test_sync_waits_for_every_cuda_device_the_model_uses(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    lm = tiny_lm(fast_path="none")
    lm.sync()
    assert synced == []  # a CPU model has nothing to wait for
    lm.cuda_devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    lm.sync()
    assert synced == lm.cuda_devices


@pytest.mark.parametrize("attn", ["flash_attention_2", "flex_attention"])
def test_attention_without_custom_masks_is_refused_at_load(attn, tmp_path):
    with pytest.raises(BenchError, match=f"model.attn_implementation='{attn}' is not supported .*use sdpa or eager"):
        TinyRandomModel(attn_implementation=attn, device="cpu").load()
    with pytest.raises(BenchError, match="use sdpa or eager"):
        PretrainedModel(name="m", path=str(tmp_path), attn_implementation=attn, device="cpu").load()


def test_memory_estimate_counts_weights_packed_copies_and_kv_cache():
    model = TinyRandomModel(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, device="cpu").build(100)
    config, bf16 = model.config, torch.bfloat16
    # rows x positions x layers x (K, V) x kv heads x head dim x bytes
    assert kv_cache_bytes(config, bf16, batch=4, tokens=50) == 4 * 50 * 3 * 2 * 2 * 16 * 2
    weights, linear = weight_bytes(config, bf16)
    assert weights == sum(p.numel() for p in model.parameters()) * 2
    assert linear == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) * 2
    need = check_memory("tiny", config, bf16, torch.device("cpu"), batch=4, tokens=50, packed=True, spread=False)
    assert need == {"weights": weights, "packed_copies": linear, "kv_cache": 4 * 50 * 3 * 2 * 2 * 16 * 2, "add_ons": 0,
                    "step": step_bytes(config, bf16, 4, 1, 50)}


def test_the_decoders_widest_step_is_estimated_and_refused_where_it_does_not_fit(monkeypatch):
    """Decoder sizes had no bound but MAX_STEP_TOKENS; the estimate now counts the
    widest step the decoder's settings allow, and a step that does not fit is one line before loading."""
    from decoders.core.contract import widest_step
    from decoders.methods.lookahead import Lookahead

    assert widest_step(Lookahead(window=5, ngram=4, guess_set_size=5)) == 1 + 3 * (5 + 5)
    assert widest_step(Lookahead(window="auto", auto_windows=[2, 9], ngram=3, guess_set_size=-1)) == 1 + 2 * 18
    assert widest_step(Eagle(tree_size=24)) == 25 and widest_step(object()) == 1  # autoregressive: one token
    config = TinyRandomModel(hidden_size=64, num_heads=4, intermediate_size=128).build(100).config
    # rows x step x (vocab x (bytes + float32 copy) + (heads + 1) x (context + step) x bytes + 3 x MLP width x bytes)
    assert step_bytes(config, torch.float32, batch=2, step=31, tokens=50) == \
        2 * 31 * (100 * 8 + 5 * 81 * 4 + 3 * 128 * 4)

    spec = TinyRandomModel(vocab_size=100, device="cpu", dtype="float32", fast_path="none")
    cpu = torch.device("cpu")
    narrow, wide = (sum(check_memory("tiny", config, torch.float32, cpu, batch=1, tokens=2048, packed=False,
                                     spread=False, step=n).values())
                    for n in (1, 4000))
    monkeypatch.setattr("bench.models.free_bytes", lambda device, spread=False: (narrow + wide) // 2)
    spec.load(step=1)
    with pytest.raises(BenchError) as e:
        spec.load(step=4000)
    message = str(e.value)
    assert "\n" not in message and "a step of 4000 tokens a row" in message and "the decoder's sizes" in message


def test_memory_estimate_counts_the_decoders_add_on_files(tmp_path, monkeypatch):
    from decoders.core.weights_file import REPO, addon_bytes
    from decoders.methods.eagle import Eagle
    from decoders.methods.medusa import Medusa

    shipped = REPO / "adapters" / "smollm2-135m-eagle.safetensors"
    assert addon_bytes(Eagle()) == shipped.stat().st_size  # the default draft, found from any directory
    published = tmp_path / "medusa-dir"  # a published checkpoint's directory: its weight files
    published.mkdir()
    (published / "medusa_lm_head.safetensors").write_bytes(b"x" * 1000)
    (published / "config.json").write_text("{}")
    assert addon_bytes(Medusa(heads=str(published))) == 1000
    assert addon_bytes(Medusa(heads=None)) == 0

    # a hub id: its largest weights file, from the hub's listing (nothing downloaded); 0 where it cannot be asked
    import huggingface_hub

    class Listing:
        def model_info(self, repo_id, files_metadata=False, timeout=None):
            assert files_metadata and repo_id == "org/medusa"
            files = [("config.json", 10), ("medusa_lm_head.pt", 700), ("medusa_lm_head.safetensors", 800)]
            return types.SimpleNamespace(siblings=[types.SimpleNamespace(rfilename=n, size=b) for n, b in files])

    monkeypatch.setattr(huggingface_hub, "HfApi", Listing)
    assert addon_bytes(Medusa(heads="org/medusa")) == 800
    monkeypatch.undo()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert addon_bytes(Medusa(heads="org/not-downloaded")) == 0
    model = TinyRandomModel(num_layers=2, device="cpu").build(100)
    need = check_memory("tiny", model.config, torch.float32, torch.device("cpu"), batch=1, tokens=10, packed=False,
                        spread=False, add_ons=12345)
    assert need["add_ons"] == 12345


def test_a_model_that_does_not_fit_is_refused_in_one_line(monkeypatch, tmp_path):
    model = TinyRandomModel(num_layers=2, device="cpu").build(100)
    model.save_pretrained(tmp_path)
    TinyRandomModel().load_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr("bench.models.free_bytes", lambda device, spread=False: 1000)
    with pytest.raises(BenchError) as e:
        PretrainedModel(name="big", path=str(tmp_path), device="cpu", dtype="float32").load(batch=8)
    message = str(e.value)
    assert "\n" not in message and message.startswith("model big: needs about")
    assert "KV cache for 8 x 2048 tokens" in message and "0.0 GiB free" in message and "model.offload=true" in message


class Placed:
    def __init__(self, placed):
        self.hf_device_map = placed


@pytest.mark.parametrize("device, offload, refused",
                         [("cuda", False, True), ("cuda", True, False), ("cpu", False, False)])
def test_device_map_offloading_only_when_asked(device, offload, refused):
    model = Placed({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "lm_head": "disk"})
    if refused:
        with pytest.raises(BenchError, match="put 2 of 4 modules on cpu and disk .* set model.offload=true"):
            check_placement("m", torch.device(device), model, offload)
    else:
        check_placement("m", torch.device(device), model, offload)


def test_provenance_records_the_device_map_and_gpus(monkeypatch):
    lm = tiny_lm(fast_path="none")
    info = provenance.collect(lm)
    assert info["device_map"] == lm.device_map() and set(info["device_map"]) == {"cpu"}
    assert info["gpu_names"] == [] and info["cuda_driver"] is None and info["cuda_version"] == torch.version.cuda
    lm.model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1, "model.norm": 1, "lm_head": "disk"}
    lm.cuda_devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: f"GPU {d.index}")
    monkeypatch.setattr(provenance, "cuda_driver", lambda: "999.1")
    info = provenance.collect(lm)
    assert info["device_map"] == {"cuda:0": 1, "cuda:1": 2, "disk": 1}
    assert info["gpu_names"] == ["GPU 0", "GPU 1"] and info["cuda_driver"] == "999.1"


# ---- on a GPU ----------------------------------------------------------------------------------
ADDON_DECODERS = {
    "medusa-seed1": Medusa(choices="chain", heads_seed=1),
    "bpd-2-p4-seed3": BPD(block=2, paths=4, ranks_per_head=3, heads_seed=3),
    "bpd-neural-p3": BPD(rescore="neural", draft=SelfDraft(layers=1), paths=3, block=3),
    "eagle-dynamic-seed1": Eagle(draft_weights=None, draft_seed=1, tree_size=10, depth=3, top_k=4),
}


ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PLACES = [pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),  # half precision runs here too: dtypes stay consistent
          pytest.param("cuda", torch.float32, id="cuda-fp32", marks=ON_CUDA),
          pytest.param("cuda", torch.float16, id="cuda-fp16", marks=ON_CUDA)]


@functools.cache
def placed(device: str, dtype: torch.dtype) -> tuple[LM, list[int]]:
    """A tiny LM on `device` in `dtype`, and its autoregressive greedy tokens."""
    lm = LM(TinyRandomModel(num_layers=2, seed=0, device=device, dtype=str(dtype).replace("torch.", "")).build(64))
    return lm, autoregressive_decode(lm, [5, 6, 7], 12, Sampling(), set()).tokens


@pytest.mark.parametrize("device, dtype", PLACES)
@pytest.mark.parametrize("name", list(ADDON_DECODERS))
def test_addon_decoders_equal_autoregressive_on_each_device(name, device, dtype):
    """Add-ons, per-step tensors and masks on the GPU and in half precision: greedy equality holds."""
    lm, reference = placed(device, dtype)
    assert ADDON_DECODERS[name].generate(lm, [5, 6, 7], 12, Sampling(), set()).tokens == reference


# ---- host-to-device copies (decoders/core/transfer.py) ------------------------------------------
@pytest.mark.parametrize("values, dtype", [([3, 1, 4], torch.long), (torch.tensor([[True, False]]), None),
                                           (torch.arange(4), torch.long), (7, torch.long)])
def test_to_device_is_as_tensor_off_the_gpu(values, dtype):
    from decoders.core.transfer import to_device
    got, want = to_device(values, "cpu", dtype), torch.as_tensor(values, dtype=dtype)
    assert got.device == want.device and got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.cuda
def test_the_forward_makes_the_host_wait_nowhere():
    """LM.forward's copies of ids, positions, a tree mask and the logit rows come from pinned memory:
    under sync debug mode "error" a forward raises nothing, where a pageable copy (the control) does.
    The one wait a step needs is the caller's read of the chosen token."""
    from decoders.core.kv_cache import causal_mask
    from decoders.core.transfer import to_device
    lm, _ = placed("cuda", torch.float16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.as_tensor([1, 2, 3], device="cuda")
        assert to_device([1, 2, 3], "cuda", torch.long).device.type == "cuda"
        cache = lm.new_cache()
        lm.forward([5, 6, 7], cache, last_only=True)
        lm.forward([8, 9], cache, position_ids=[3, 4], mask=causal_mask(2, 3), logits_rows=[1, 0])
        lm.forward([10], cache, last_only=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def host_reads(run) -> dict:
    """Where `run()` made the host wait for the GPU: sync debug mode "warn", counted by our code's
    lines ("path:line"). `run` goes once uncounted first: the first call in a process may wait once
    inside torch (an H200 counted one extra there)."""
    import warnings
    from collections import Counter
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    run()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return Counter(f"{Path(w.filename).relative_to(repo)}:{w.lineno}" for w in caught
                   if "synchroniz" in str(w.message) and Path(w.filename).resolve().is_relative_to(repo))


@pytest.mark.cuda
def test_drafts_reach_the_host_in_one_read():
    """A draft chain of 4, a draft tree of depth 3 and BPD's lattice of 4 positions (ranked by the heads
    alone on the host, or rescored by a neural LM on the GPU) each wait for the GPU once, when the
    finished draft is read (the chain's and the tree's tokens by tree.host_tokens: in a decode they are
    read with verification instead, test_a_draft_step_waits_once); the control reads every token as it
    is drawn."""
    from decoders.core.sampling import Sampler, argmax
    from decoders.core.tree import host_tokens
    from decoders.methods.bpd import NeuralScorer, lattice_beam_search
    from decoders.methods.draft_tree import draft_tree
    from decoders.methods.spec_chain import draft_chain
    lm, _ = placed("cuda", torch.float16)
    greedy = Sampler(Sampling(), "cuda")
    sequence = [5, 6, 7]
    control = host_reads(lambda: [argmax(lm.forward([t], lm.new_cache())[-1]) for t in sequence])
    assert sum(control.values()) == 3, control
    parents = [-1, 0, 0, 1, 1, 2, 3]  # depth 3, two inner levels fed
    head_logp = torch.log_softmax(torch.randn(4, 64, device="cuda"), -1)
    scorer = NeuralScorer(lm)

    def rescored():
        scorer.start(sequence)
        lattice_beam_search(head_logp, 3, 2, 1.0, scorer, on_host=False)
        scorer.finish()

    for run in (lambda: host_tokens(draft_chain(lm, lm.new_cache(), sequence, 4, greedy)[0]),
                lambda: host_tokens(draft_tree(lm, lm.new_cache(), sequence, parents, greedy).tokens),
                lambda: lattice_beam_search(head_logp, 3, 2, 1.0, None), rescored):
        reads = host_reads(run)
        assert sum(reads.values()) == 1, reads


@pytest.mark.cuda
def test_draft_tree_levels_copy_nothing_from_the_host(monkeypatch):
    """A greedy draft tree's levels feed the draft tensors already on the GPU (its shape's plan): a tree
    of three fed levels pins as many host buffers as one of a single level, the catch-up's. The
    control, with the plan never matching, copies each level's mask and positions."""
    import dataclasses
    import decoders.methods.draft_tree as tree_module
    from decoders.core.sampling import Sampler
    lm, _ = placed("cuda", torch.float16)
    greedy = Sampler(Sampling(), "cuda")
    one_level, three_levels = (-1, 0, 0, 1), (-1, 0, 0, 1, 1, 2, 3, 5, 6)

    def pins(parents) -> int:
        tree_module.draft_tree(lm, lm.new_cache(), [5, 6, 7], parents, greedy)  # makes the plan
        count, real = [], torch.Tensor.pin_memory
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: count.append(1) or real(t, *a))
        tree_module.draft_tree(lm, lm.new_cache(), [5, 6, 7], parents, greedy)
        monkeypatch.setattr(torch.Tensor, "pin_memory", real)
        return len(count)

    assert pins(three_levels) == pins(one_level)
    plan = tree_module.tree_plan
    monkeypatch.setattr(tree_module, "tree_plan", lambda *a: dataclasses.replace(
        plan(*a), levels=tuple(() for _ in plan(*a).levels)))
    assert pins(three_levels) >= pins(one_level) + 4


WAIT_ONCE = {"eagle-dynamic": lambda: Eagle(draft_weights=None, draft_seed=1, tree_size=10, depth=3, top_k=4),
             "eagle-static": lambda: Eagle(draft_weights=None, draft_seed=1, tree="static", tree_size=10, depth=3,
                                           top_k=4),
             "spec_chain": lambda: SpecChain(draft=SelfDraft(layers=1), depth=4),
             "sequoia": lambda: Sequoia(draft=SelfDraft(layers=1), budget=8, depth=4, auto_tokens=16),
             "medusa": lambda: Medusa(choices=[[0], [1], [0, 0], [2], [0, 1], [0, 0, 0]], num_heads=3, heads_seed=2)}


@pytest.mark.cuda
@pytest.mark.parametrize("name", WAIT_ONCE)
def test_a_draft_step_waits_once(name, monkeypatch):
    """A drafted tree stays on the GPU until verification reads it with the argmax (tree.DeviceTree): a
    timed decode waits once a step, its timer included (trace.DeviceTracer: events, read at the end; two
    more allowed). The control, reading each tree as soon as it is drafted, waits twice a step."""
    import decoders.core.transfer as transfer
    lm, _ = placed("cuda", torch.float16)
    assert lm.timing_event is not None
    decoder, steps = WAIT_ONCE[name](), []

    def run():
        steps.append(len(decoder.generate(lm, [5, 6, 7, 5, 6, 7], 16, Sampling(), set()).steps))

    deferred = sum(host_reads(run).values())
    monkeypatch.setattr(transfer, "reads_wait", lambda device: False)
    at_once = sum(host_reads(run).values())
    n = steps[-1]
    assert n >= 4 and deferred <= n + 2 < 2 * n - 2 <= at_once, (n, deferred, at_once)
