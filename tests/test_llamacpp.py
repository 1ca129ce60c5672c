"""model.backend=llamacpp: the harness's decoders on llama.cpp (decoders/core/llamacpp.py), on SmolLM2's GGUF as
shipped (Q4_1) and converted to F32, and on Gemma 3 270M's as shipped (Q4_K_M, sliding-window layers). A tree
verified in one llama_decode gives each node the logits of its own path; every method that reads logits only
equals the engine's own one-token decoding (or departs at ties the lossless check proves); a method needing what
the engine does not give is refused before anything loads."""
from __future__ import annotations

import json
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

pytestmark = pytest.mark.slow  # the real SmolLM2 and Gemma 3 files

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


@pytest.fixture(scope="module")
def gemma():
    return build(composed(["model=gemma3-270m"]).model, "model").load(step=64)


@pytest.fixture(scope="module")
def gemma_prompt(gemma, data_dir):
    from bench.datasets import GSM8K

    return render(gemma.tokenizer, GSM8K(limit=1, data_dir=str(data_dir)).load()[0], 0, [], "raw")[1]


def test_it_reads_the_file_as_shipped(q4):
    assert q4.weights_type == "Q4_1" and q4.vocab_size == 49152 and q4.stop_ids == {2}
    assert q4.source["engine"]["kv_type"] == "f16"
    assert q4.flops_spec()["matmul_params"] == 134_515_008  # the torch path's count of the same model


def chain_logits(lm, prompt: list[int], path: list[int], then: list[int] = ()) -> torch.Tensor:
    """The logits after prompt + path (+ then), fed as a tree step feeds them: the prompt but its last token, then
    the rest causally (then, one more forward): llama.cpp's kernels round a batch by its size, so a chain fed
    in the same batches is the tree's exact peer."""
    cache = lm.new_cache()
    lm.forward(prompt[:-1], cache, last_only=True)  # the prefix's cells; one row of logits
    logits = lm.forward([prompt[-1], *path], cache)
    return lm.forward(list(then), cache, last_only=True)[0] if then else logits[-1]


def padded_logits(lm, prompt: list[int], path: list[int], size: int) -> torch.Tensor:
    """The logits after prompt + path, the path fed as the only branch of a step of `size` tokens: filler tokens
    beside it, children of the root, which the path does not see."""
    tokens = [prompt[-1], *path, *range(1000, 1000 + size - len(path) - 1)]
    tree = TokenTree(tokens=tokens, parents=[-1, *range(len(path)), *[0] * (size - len(path) - 1)])
    cache = lm.new_cache()
    lm.forward(prompt[:-1], cache, last_only=True)  # the prefix's cells; one row of logits
    mask, positions = layout(len(cache), 1, tree)
    return lm.forward(tokens, cache, position_ids=positions, mask=mask, logits_last=size)[len(path)]


@pytest.mark.parametrize("model", ["q4", "gemma"])
def test_a_tree_in_one_decode_scores_each_node_as_its_own_path(model, request):
    """Each node's logits from one llama_decode over a random tree are, bit for bit, those of its own path alone
    (node i's ancestors only: the sequence ids carry the tree's mask). SmolLM2's Q4_1: the path fed as a chain in
    the same batches. Gemma 3's Q4_K_M, whose sliding-window layers mask by position too: the path as the only
    branch of a step of the tree's size, since llama.cpp's repacked Q4_K kernels compute rows in tiles of 4 and the
    rest one by one, so a row's rounding follows the batch's size (a chain of another length lands up to 1.0 away
    in the logits)."""
    q4 = request.getfixturevalue(model)
    prompt = request.getfixturevalue("prompt" if model == "q4" else "gemma_prompt")
    rng = random.Random(0)
    size = 24 if model == "q4" else 16
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    tree = TokenTree(tokens=[prompt[-1]] + [rng.randrange(1000, 9000) for _ in parents[1:]], parents=parents)
    cache = q4.new_cache()
    q4.forward(prompt[:-1], cache, last_only=True)  # the prefix's cells; one row of logits
    mask, positions = layout(len(cache), 1, tree)
    logits = q4.forward([prompt[-1], *tree.tokens[1:]], cache, position_ids=positions, mask=mask,
                        logits_last=len(tree))
    del cache

    def alone(path):
        return chain_logits(q4, prompt, path) if model == "q4" else padded_logits(q4, prompt, path, len(tree))

    paths = [[tree.tokens[n] for n in ([*reversed(ancestors(parents, node)), node] if node else [])]
             for node in range(len(tree))]
    for node, path in enumerate(paths):
        assert torch.equal(logits[node], alone(path)), node
    other = next(n for n in range(2, len(tree)) if parents[n] != 1)  # negative control: another node's path
    assert not torch.allclose(alone([tree.tokens[1], tree.tokens[other]]), logits[other])


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
    f32.forward(prompt[:-1], cache, last_only=True)  # the prefix's cells; one row of logits
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


def test_gemma_as_shipped_is_lossless(gemma, gemma_prompt):
    """Gemma 3 270M's Q4_K_M file as shipped: lookahead (a window beside its n-gram tree) and prompt lookup equal
    the engine's one-token decoding, or depart at ties only."""
    assert gemma.weights_type.startswith("Q4_K") and gemma.vocab_size == 262144 and 1 in gemma.stop_ids
    reference = greedy_reference(gemma, gemma_prompt, 24, gemma.stop_ids)
    for method in ("lookahead", "prompt_lookup"):
        out = decoder_on(method, ["model=gemma3-270m"]).generate(gemma, gemma_prompt, 24, Sampling(), gemma.stop_ids)
        verdict = judge_lossless(gemma, gemma_prompt, out.tokens, reference.tokens)
        assert verdict["lossless"] or verdict["divergence_tie"], (method, verdict)


def test_the_referee_computes_the_prefix_batched_two_ways(gemma, gemma_prompt):
    """The lossless check's second computations on Q4_K_M: the prefix in one forward, and with its last 4 tokens
    as a batch of their own after the rest. The repacked Q4_K kernels round a row by its batch, so the two are
    two computations of the same logits that disagree, and a departure within their spread is a tie."""
    from decoders.methods.autoregressive import referee_logits

    tokens = greedy_reference(gemma, gemma_prompt, 8, gemma.stop_ids).tokens
    referee = referee_logits(gemma, gemma_prompt, tokens)
    for i in range(4):
        seconds = referee(i)
        assert seconds.shape == (2, gemma.vocab_size) and torch.isfinite(seconds).all()
        assert float((seconds[0] - seconds[1]).abs().max()) > 1e-3, i


def composed(extra: list[str]):
    from hydra import compose, initialize_config_dir

    from bench.registry import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["model.backend=llamacpp", f"cache_dir='{CACHE_DIR}'", *extra])


def decoder_on(method: str, extra: list[str]):
    return check_config(composed([f"decoder={method}", *extra]))[1]


@pytest.mark.parametrize("method,needs", [("eagle", "before the final norm"), ("medusa", "the last hidden state"),
                                          ("hf_generate", "torch modules"), ("spec_chain", "draft=self")])
def test_what_the_engine_cannot_give_is_refused_in_one_line(method, needs):
    with pytest.raises(BenchError, match=f"cannot run on llama.cpp.*{needs}") as e:
        decoder_on(method, [])
    assert "\n" not in str(e.value)


def test_the_cli_refuses_before_claiming_a_directory(tmp_path):
    """python -m bench with a method the engine cannot serve: exit 2, one line, no run directory."""
    from helpers import run_cli

    run_dir = tmp_path / "run"
    out = run_cli("model.backend=llamacpp", "decoder=medusa", f"hydra.run.dir={run_dir}")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert "cannot run on llama.cpp" in out.stderr and not run_dir.exists()


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


def test_side_by_side_and_a_forecast_at_llama_cpps_prices(tmp_path, capsys):
    """scripts/engines_side_by_side.py on the shipped file (3 methods, one with a GGUF draft; 1 prompt) writes its
    runs, the engine's k-token cost curve and the table with the lossless check and the draft each method ran;
    bench.forecast prices those runs at that profile."""
    from bench.forecast import main as forecast
    from test_scripts import run_script

    out = run_script("engines_side_by_side.py", "--out", str(tmp_path), "--engines", "llamacpp", "--methods",
                     "autoregressive,prompt_lookup,spec_chain", "--llamacpp-draft", "smollm2-135m", "--curve", "1,2,4",
                     "--curve-repeats", "1",
                     "dataset=gsm8k", "dataset.limit=1", "gen.max_new_tokens=12", "quality=false", "threads=1")
    assert out.returncode == 0, out.stderr[-2000:]
    import pandas as pd

    table = pd.read_csv(tmp_path / "table.csv").set_index("method")
    assert list(table.index) == ["autoregressive", "prompt_lookup", "spec_chain"]
    assert set(table["engine"]) == {"llamacpp"}
    assert table.loc["spec_chain", "draft"] == "smollm2-135m (GGUF as shipped)"  # the table says which draft ran
    assert table["draft"].isna().sum() == 2  # the model-free methods name none
    assert (table["lossless_up_to_ties"] == 1.0).all() and (table["real_divergences"] == 0).all()
    assert list(pd.read_csv(tmp_path / "profiles" / "llamacpp" / "profile.csv")["tokens"]) == [1, 2, 4]
    run = pd.read_json(tmp_path / "llamacpp" / "autoregressive" / "records.jsonl", lines=True)
    profiled = json.loads((tmp_path / "profiles" / "llamacpp" / "provenance.json").read_text())["context_tokens"]
    assert profiled == run["prompt_tokens"][0] + 12 // 2  # priced where the run's middle step sits
    capsys.readouterr()
    forecast([str(tmp_path / "llamacpp"), "--profile", str(tmp_path / "profiles" / "llamacpp"),
              "--out", str(tmp_path / "forecast")])
    forecasted = pd.read_csv(tmp_path / "forecast" / "forecast.csv")
    assert sorted(forecasted["decoder"]) == ["autoregressive", "prompt_lookup", "spec_chain"]
    assert forecasted[["forecast_speedup", "forecast_tokens_per_s", "measured_tokens_per_s"]].notna().all().all()


def test_the_examples_read_our_prompt_as_is_and_are_compared_where_both_go(tmp_path):
    """scripts/llamacpp_examples.py hands llama.cpp's examples the rendered prompt in argv with escapes off (a prompt
    file loses its final newline, escapes rewrite backslashes), reads their log, and compares their continuation
    with ours as far as both go. A stand-in binary echoes what it was given, as the examples print it."""
    from helpers import script_module

    examples = script_module("scripts/llamacpp_examples.py")
    fake = tmp_path / "llama-lookup"
    fake.write_text("#!/usr/bin/env python3\nimport sys\nargs = sys.argv[1:]\nassert '--no-escape' in args\n"
                    "prompt = args[args.index('-p') + 1]\nprint('\\n\\n' + prompt + ' 42, so 6.\\n\\n', end='')\n"
                    "print('encoded   %d tokens in 0.1 seconds' % len(prompt.split()), file=sys.stderr)\n"
                    "print('decoded   12 tokens in 0.50 seconds, speed: 24.0 t/s\\nn_accept  = 5', file=sys.stderr)\n")
    fake.chmod(0o755)
    text = "A \\n literal and a last newline\n"
    got = examples.run_example(fake, tmp_path / "m.gguf", text, 12, 1)
    assert got["continuation"] == " 42, so 6.\n\n"  # the prompt came back whole: its newline and backslash kept
    assert (got["prompt_tokens"], got["tokens_per_s"], got["n_accept"]) == (7, 24.0, 5)
    assert examples.same_start(" 42, so 6. Then", got["continuation"])
    assert not examples.same_start(" 41, so 6.", got["continuation"])  # the negative control
    assert not examples.same_start(" 42", None)
