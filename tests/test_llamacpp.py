"""model.backend=llamacpp: the harness's decoders on llama.cpp (decoders/core/llamacpp.py), on SmolLM2's GGUF as
shipped (Q4_1) and converted to F32. A tree verified in one llama_decode gives each node the logits of its own
path; every method that reads logits only equals the engine's own one-token decoding (or departs at ties the
lossless check proves); a method needing what the engine does not give is refused before anything loads."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from bench.errors import BenchError
from bench.models import GGUFPackageModel
from bench.prompts import render
from bench.runner import build, check_config, judge_lossless
from decoders.core.loop import layout
from decoders.core.sampling import Sampling
from decoders.core.tree import TokenTree, ancestors
from helpers import CACHE_DIR, greedy_reference
from test_greedy_equality import METHODS

pytestmark = pytest.mark.slow  # the real SmolLM2 file

LOGITS_ONLY = ["autoregressive", "jacobi", "lookahead", "recycling", "prompt_lookup", "suffix", "oracle",
               "spec_chain", "specinfer", "sequoia"]
NEW = 40


def spec(dtype: str = "auto") -> GGUFPackageModel:
    return GGUFPackageModel(cache_dir=CACHE_DIR, backend="llamacpp", dtype=dtype)


@pytest.fixture(scope="module")
def q4():
    return spec().load(step=64)


@pytest.fixture(scope="module")
def prompt(q4, data_dir):
    from bench.datasets import GSM8K

    return render(q4.tokenizer, GSM8K(limit=1, data_dir=str(data_dir)).load()[0], 0, [], "chat")[1]


def test_it_reads_the_file_as_shipped(q4):
    assert q4.weights_type == "Q4_1" and q4.vocab_size == 49152 and q4.stop_ids == {2}
    assert q4.source["engine"]["kv_type"] == "f16"
    assert q4.flops_spec()["matmul_params"] == 134_515_008  # the torch path's count of the same model


def chain_logits(lm, prompt: list[int], path: list[int], then: list[int] = ()) -> torch.Tensor:
    """The logits after prompt + path (+ then), fed as a tree step feeds them: the prompt but its last token, then
    the rest causally (then, one more forward): llama.cpp's kernels round a batch by its size, so a chain fed
    in the same batches is the tree's exact peer."""
    cache = lm.new_cache()
    lm.forward(prompt[:-1], cache)
    logits = lm.forward([prompt[-1], *path], cache)
    return lm.forward(list(then), cache, last_only=True)[0] if then else logits[-1]


def test_a_tree_in_one_decode_scores_each_node_as_its_own_path(q4, prompt):
    """Each node's logits from one llama_decode over a random tree are, bit for bit, those of its own path fed as
    a chain in the same batches (node i's ancestors only: the sequence ids carry the tree's mask)."""
    rng = random.Random(0)
    parents = [-1] + [rng.randrange(i) for i in range(1, 24)]
    tree = TokenTree(tokens=[prompt[-1]] + [rng.randrange(1000, 9000) for _ in parents[1:]], parents=parents)
    cache = q4.new_cache()
    q4.forward(prompt[:-1], cache)
    mask, positions = layout(len(cache), 1, tree)
    logits = q4.forward([prompt[-1], *tree.tokens[1:]], cache, position_ids=positions, mask=mask,
                        logits_last=len(tree))
    del cache
    paths = [[tree.tokens[n] for n in ([*reversed(ancestors(parents, node)), node] if node else [])]
             for node in range(len(tree))]
    for node, path in enumerate(paths):
        assert torch.equal(logits[node], chain_logits(q4, prompt, path)), node
    other = next(n for n in range(2, len(tree)) if parents[n] != 1)  # negative control: another node's path
    assert not torch.allclose(chain_logits(q4, prompt, [tree.tokens[1], tree.tokens[other]]), logits[other])


@pytest.fixture(scope="module")
def f32():
    return spec("float32").load(step=64)


def test_keep_leaves_the_accepted_path(f32, prompt):
    """After a tree step keeps one branch, the next forward's logits are those after that branch alone, up to the
    rounding of cells that now sit elsewhere in the cache (the F32 file: Q4_1's quantized activations turn such a
    rounding into a logit's difference) and unlike those after the sibling branch."""
    a, b, c, d, e = (f32.tokenizer.encode(w)[0] for w in (" The", " She", " sold", " ate", " and"))
    tree = TokenTree(tokens=[prompt[-1], a, b, c, d], parents=[-1, 0, 0, 2, 2])
    cache = f32.new_cache()
    f32.forward(prompt[:-1], cache)
    mask, positions = layout(len(cache), 1, tree)
    f32.forward(tree.tokens, cache, position_ids=positions, mask=mask)
    n = len(prompt) - 1
    cache.keep(list(range(n + 1)) + [n + 2, n + 4])  # the root, node 2 (She), node 4 (ate)
    after = f32.forward([e], cache, last_only=True)[0]
    del cache
    kept, sibling = chain_logits(f32, prompt, [b, d], [e]), chain_logits(f32, prompt, [b, c], [e])
    assert int(after.argmax()) == int(kept.argmax())
    assert float((after - kept).abs().max()) < 0.05 < float((after - sibling).abs().max())


@pytest.mark.parametrize("method", LOGITS_ONLY)
def test_every_logits_method_is_lossless(q4, prompt, method):
    """Greedy equality with llama.cpp's own one-token decoding, or departures at ties only, as judged by the
    lossless check; on the shipped Q4_1 file, drafts (spec_chain, specinfer, sequoia) from the same file."""
    assert method in METHODS
    draft = ["draft=smollm2-135m"] if method in ("spec_chain", "specinfer", "sequoia") else []
    decoder = decoder_on(method, draft)
    if draft:  # conf/draft/smollm2-135m.yaml follows the target's model.backend
        assert isinstance(decoder.load_addons(q4), type(q4))
    reference = greedy_reference(q4, prompt, NEW, q4.stop_ids)
    if hasattr(decoder, "foresee"):
        decoder.foresee(q4, prompt, NEW, q4.stop_ids)
    out = decoder.generate(q4, prompt, NEW, Sampling(), q4.stop_ids)
    verdict = judge_lossless(q4, prompt, out.tokens, reference.tokens)
    assert verdict["lossless"] or verdict["divergence_tie"], verdict
    if method != "autoregressive":
        assert len(out.steps) < len(reference.steps) or method in ("jacobi",), "no step saved"


def decoder_on(method: str, extra: list[str]):
    from hydra import compose, initialize_config_dir

    from bench.registry import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"decoder={method}", "model.backend=llamacpp", f"cache_dir='{CACHE_DIR}'",
                                           *extra])
    return check_config(cfg)[1]


@pytest.mark.parametrize("method,needs", [("eagle", "before the final norm"), ("medusa", "the last hidden state"),
                                          ("hf_generate", "torch modules"), ("spec_chain", "draft=self")])
def test_what_the_engine_cannot_give_is_refused_in_one_line(method, needs):
    with pytest.raises(BenchError, match=f"cannot run on llama.cpp.*{needs}") as e:
        decoder_on(method, [])
    assert "\n" not in str(e.value)


def test_the_f32_copy_holds_the_torch_paths_weights(f32):
    """dtype=float32: llama.cpp's own F32 conversion of the file, whose tensors are the dequantized weights the
    torch path decodes (the same numbers, so the two engines differ only in their kernels)."""
    import gguf

    assert f32.weights_type == "all F32" and f32.source["engine"]["kv_type"] == "f32"
    reader = gguf.GGUFReader(f32.gguf)
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    tensor = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    torch_path = GGUFPackageModel(cache_dir=CACHE_DIR, dtype="float32", fast_path="none").local_dir()
    from safetensors import safe_open

    with safe_open(str(torch_path / "model.safetensors"), "pt") as f:
        expected = f.get_tensor("model.layers.3.mlp.down_proj.weight")
    assert np.array_equal(np.asarray(tensor.data).reshape(expected.shape), expected.numpy())


def test_the_model_config_takes_the_backend():
    with pytest.raises(BenchError, match="model.backend='onnx'"):
        build({"_target_": "bench.models.GGUFPackageModel", "backend": "onnx"}, "model")
    with pytest.raises(BenchError, match="dtype='bfloat16' is not allowed"):
        build({"_target_": "bench.models.GGUFPackageModel", "backend": "llamacpp", "dtype": "bfloat16"}, "model")


def test_llama_cpps_errors_are_raised_and_shown(q4, capsys):
    """A feed llama.cpp refuses (a position gap in a sequence) raises, and llama.cpp's own reason reaches stderr
    (llama-cpp-python's logger read its error level as debug and hid it)."""
    cache = q4.new_cache()
    q4.forward([1, 2, 3], cache)
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        q4.forward([5], cache, position_ids=[9], mask=np.ones((1, 4), bool))
    assert "inconsistent sequence positions" in capsys.readouterr().err
