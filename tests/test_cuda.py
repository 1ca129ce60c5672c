"""On CUDA: every decoder end to end through `python -m bench`, and the training scripts for a
step. The half-precision slice (tests/test_half_precision.py) runs on CUDA under the same
marker. Where torch.cuda.is_available() is False, tests/conftest.py skips all of it, saying why.

Each run checks itself against autoregressive greedy (check_lossless=true), in float16 and
bfloat16, at batch 1 and 4 (decoders that batch), on tiny-random and on SmolLM2: in half
precision, lossless means up to ties (bench/metrics.py, judge_output), so the assertion is that
no output departs where no tie explains it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from bench.registry import decoder_configs
from helpers import REPO, TINY_TOKENIZER, run_cli
from test_scripts import run_script

pytestmark = pytest.mark.cuda

DECODERS = list(decoder_configs())  # every method (bench/registry.py)
# tiny-random has no trained add-ons: untrained heads, EAGLE and block drafts, a one-layer self-draft.
TINY = ["model=tiny-random", "model.num_layers=3", "draft.layers=1", "draft.adapter=null", *TINY_TOKENIZER]
UNTRAINED = {"medusa": ["decoder.heads=null"], "bpd": ["decoder.heads=null", "decoder.rescore=ngram"],
             "eagle": ["decoder.draft_weights=null"], "dflash": ["decoder.draft_weights=null"]}
MODELS = {"tiny-random": lambda decoder: [*TINY, *UNTRAINED.get(decoder, [])],
          "smollm2-135m": lambda decoder: ["model=smollm2-135m"]}  # its shipped heads, EAGLE draft, adapter


def batches(decoder: str) -> bool:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from decoders.core.contract import Batches
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"decoder={decoder}"])
    return isinstance(instantiate(cfg.decoder, _convert_="all"), Batches)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("model", [pytest.param("tiny-random"), pytest.param("smollm2-135m", marks=pytest.mark.slow)])
@pytest.mark.parametrize("decoder", DECODERS)
def test_decoder_end_to_end_on_cuda(tmp_path, decoder, model, dtype, batch):
    if batch > 1 and not batches(decoder):
        pytest.skip(f"{decoder} decodes one prompt at a time")
    out = run_cli(f"decoder={decoder}", *MODELS[model](decoder), "device=cuda", f"dtype={dtype}",
                  f"gen.batch_size={batch}", "dataset=gsm8k", "dataset.limit=4", "gen.max_new_tokens=16",
                  "check_lossless=true", "progress=false", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    assert provenance["device"].startswith("cuda") and provenance["dtype"] == dtype
    row = pd.read_csv(tmp_path / "summary.csv").iloc[0]
    assert row["records"] == 4 and row["real_divergences"] == 0, \
        [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines() if '"divergence_tie": false' in x]
    assert row["lossless_up_to_ties"] == 1.0


def _one_step(tmp_path: Path, script: str, *args: str):
    out = run_script(script, *args, "model=tiny-random", *TINY_TOKENIZER, "device=cuda", f"cache_dir={tmp_path}",
                     timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]


CORPUS = ["--gsm8k-questions", "2", "--answer-tokens", "8"]  # the self-distilled answers: few and short


def test_train_heads_one_step_on_cuda(tmp_path):
    _one_step(tmp_path, "train_heads.py", "--steps", "1", "--heads", "2", "--seq-len", "32", "--batch", "2", *CORPUS,
              "--out", str(tmp_path / "heads.safetensors"))
    assert (tmp_path / "heads.safetensors").is_file()


def test_train_eagle_one_step_on_cuda(tmp_path):
    _one_step(tmp_path, "train_eagle.py", "--chunks", "2", "--epochs", "1", "--generated-repeats", "1", "--unroll", "2",
              "--seq-len", "32", "--batch", "2", "--draft-vocab", "40", "--depth", "3", *CORPUS,
              "--out", str(tmp_path / "eagle.safetensors"))
    assert (tmp_path / "eagle.safetensors").is_file()


def test_train_eagle3_one_step_on_cuda(tmp_path):
    _one_step(tmp_path, "train_eagle.py", "--layout", "eagle3", "--chunks", "2", "--epochs", "1", "--generated-repeats",
              "1", "--unroll", "2", "--seq-len", "32", "--batch", "2", "--draft-vocab", "40", "--depth", "3", *CORPUS,
              "--out", str(tmp_path / "eagle3"), "model.num_layers=8")
    assert (tmp_path / "eagle3" / "model.safetensors").is_file()


def test_train_exit_adapter_one_step_on_cuda(tmp_path):
    _one_step(tmp_path, "train_exit_adapter.py", "--steps", "1", "--seq-len", "32", "--batch", "2", "--generated", "1",
              "--heldout", "1", "--out", str(tmp_path / "adapter.safetensors"), "draft.layers=1")
    assert (tmp_path / "adapter.safetensors").is_file()


def test_a_model_on_the_gpu_attends_by_one_kernel_for_every_query_count():
    """cuDNN's attention replans for each new context length (57-70 ms a decode step against 18-21
    on Vicuna-7B's shape) and flash cannot take a tree's mask: decoders/core/lm.py leaves the
    memory-efficient kernel, whichever torch would have chosen."""
    import torch

    from bench.runner import build
    from hydra import compose, initialize_config_dir
    for kernel in ("cudnn", "flash", "mem_efficient"):
        getattr(torch.backends.cuda, f"enable_{kernel}_sdp")(True)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, "device=cuda"])
    lm = build(cfg.model, "model").load()
    assert lm.device.type == "cuda"
    assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.mem_efficient_sdp_enabled()


@pytest.mark.parametrize("mode", ["deterministic", "iid", "without"])
def test_sampled_tree_verification_waits_once_a_step(mode):
    """verify_sampling on a GPU: one host wait a step (the read of every try's values and draws), for a
    31-node tree of 5 children a node, whatever is accepted. tests/test_verify.py counts the reads on a CPU."""
    import torch

    from decoders.core.transfer import sync_counter
    from decoders.core.tree import TokenTree
    from decoders.core.verify import verify_sampling

    g, V = torch.Generator().manual_seed(0), 32
    parents = [-1] + [0] * 5 + [1 + i // 5 for i in range(25)]
    tokens = [0] * len(parents)
    for children in TokenTree(tokens, parents).children:
        for child, token in zip(children, torch.randperm(V, generator=g).tolist()):
            tokens[child] = token
    tree = TokenTree(tokens, parents)
    target = torch.softmax(torch.randn(len(tree), V, generator=g), -1).cuda()
    draft = None if mode == "deterministic" else torch.full((len(tree), V), 1 / V).cuda()
    generator = torch.Generator(device="cuda").manual_seed(0)
    verify_sampling(tree, target, draft, generator, without_replacement=mode == "without")  # warm-up
    torch.cuda.synchronize()
    for _ in range(5):
        with sync_counter(REPO) as sites:
            verify_sampling(tree, target, draft, generator, without_replacement=mode == "without")
        assert sum(sites.values()) == 1, dict(sites)
