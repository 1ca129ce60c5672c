"""EAGLE-1 drafts in their authors' layout, built with the authors' own module (PyPI's eagle-llm,
`eagle.model.cnets.Model`), for tiny targets: the reference tests/test_published_checkpoints.py checks
our loader (decoders/methods/published.py) against, and the draft the authors' eagenerate runs with in
results/reference/eagle_authors_overhead/.

    from decoders.methods.eagle1_layout import eagle1_reference_module, save_eagle1, write_eagle1

    model, config = eagle1_reference_module(lm, seed=1)    # the authors' module, random, on lm's embedding
    save_eagle1(path, model, config)                        # path/pytorch_model.bin + path/config.json
    write_eagle1(path, lm, seed=1)                          # both at once

eagle-llm is installed without its dependencies (`pip install --no-deps eagle-llm`, the README's
test command): it pins transformers 4.
"""
from __future__ import annotations

import json
import types
from pathlib import Path

import torch
from safetensors.torch import save_file


def eagle1_reference_module(lm, seed: int):
    """The authors' EAGLE-1/2 draft (eagle-llm's cnets.Model), randomly initialised, its embedding the
    target's (as ea_model.py loads it), and the config.json that describes it. Under transformers 5 a
    PretrainedConfig always holds rope_scaling {'rope_type': 'default', ...}, which cnets'
    `rope_scaling is None` test misreads as a scaling to apply (KeyError 'type'); a plain namespace
    with the fields it reads avoids that."""
    try:
        from eagle.model.cnets import Model
    except ImportError as e:
        raise ImportError("the EAGLE-1/2 reference is the authors' module: "
                          "pip install --no-deps eagle-llm (the README's test command)") from e
    cfg = lm.config
    ns = types.SimpleNamespace(vocab_size=lm.vocab_size, hidden_size=cfg.hidden_size,
                               intermediate_size=cfg.intermediate_size,
                               num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads,
                               num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=2048,
                               rms_norm_eps=cfg.rms_norm_eps, rope_scaling=None, pretraining_tp=1, hidden_act="silu",
                               pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Model(ns).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms near 1, the rest near their initial values: a draft that disagrees
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if "norm" in name else p + noise)
        model.embed_tokens.weight.copy_(lm.model.get_input_embeddings().weight)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": ns.hidden_size,
              "intermediate_size": ns.intermediate_size,
              "num_attention_heads": ns.num_attention_heads, "num_key_value_heads": ns.num_key_value_heads,
              "num_hidden_layers": 1, "vocab_size": ns.vocab_size, "rms_norm_eps": ns.rms_norm_eps,
              "hidden_act": "silu", "max_position_embeddings": 2048, "bias": True}
    return model, config


def save_eagle1(path, model, config: dict, fmt: str = "bin", embed: bool = True, **config_extra) -> None:
    """`model`'s weights as the authors publish them (pytorch_model.bin, which their from_pretrained
    reads, or model.safetensors; without embed_tokens unless `embed`) beside config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.clone() for k, v in model.state_dict().items() if embed or k != "embed_tokens.weight"}
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config, **config_extra}))


def write_eagle1(path, lm, seed: int, fmt: str = "bin", embed: bool = True, **config_extra):
    """A random EAGLE-1 draft for `lm` in the authors' layout at `path`; returns the authors' module."""
    model, config = eagle1_reference_module(lm, seed)
    save_eagle1(path, model, config, fmt, embed, **config_extra)
    return model
