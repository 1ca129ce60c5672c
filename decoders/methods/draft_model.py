"""Draft models for speculative decoding: any LM sharing the target's tokenizer, or a
self-draft cut from the target itself (its first k layers, its final norm and head).

A truncated model's layer-k hidden state is not what the head was trained on, so the
self-draft can carry a small exit adapter (RMSNorm + a residual d x d projection, zero at
initialisation) trained by scripts/train_exit_adapter.py with the backbone frozen.
The self-draft shares the target's weights: it costs no memory beyond the adapter.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..core.lm import LM
from ..core.weights_file import addon_path, load_state, load_weights, meta_int, save_weights

ADAPTER_FORMAT = "exit-adapter-v1"
DRAFT_REQUIRED = "draft=self (the target's first layers) or draft=<model>"


class ExitAdapter(nn.Module):
    """h -> h + W norm(h), W zero-initialised, so an untrained adapter is the plain truncation."""

    def __init__(self, norm: nn.Module, hidden_size: int):
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(self.norm(hidden))


def _decoder_parts(model):
    """(embed, layers, final norm, rotary, head) of a Llama-family causal LM, or a clear error."""
    base = model.base_model
    parts = [getattr(base, a, None) for a in ("embed_tokens", "layers", "norm", "rotary_emb")]
    if any(p is None for p in parts) or model.get_output_embeddings() is None:
        raise ValueError(f"a self-draft needs a Llama-style decoder (embed_tokens, layers, norm, rotary_emb, lm_head); "
                         f"{type(model).__name__} has another layout: give draft= a separate model instead")
    return (*parts, model.get_output_embeddings())


def check_layers(target, layers: int) -> None:
    total = len(_decoder_parts(target)[1])
    if not (isinstance(layers, int) and 1 <= layers < total):
        raise ValueError(f"draft.layers must be an integer in [1, {total - 1}] for a {total}-layer target, "
                         f"got {layers!r}")


def self_draft_model(target, layers: int, adapter: nn.Module | None = None):
    """A model of the target's class whose modules ARE the target's first `layers` layers, its
    embeddings, final norm and head (shared, not copied), with `adapter` before the final norm."""
    embed, blocks, norm, rotary, head = _decoder_parts(target)
    check_layers(target, layers)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    for key in ("layer_types", "mlp_layer_types"):  # per-layer lists must match the new depth
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, getattr(config, key)[:layers])
    with torch.device("meta"):
        draft = type(target)(config)
    base = draft.base_model
    base.embed_tokens = embed
    base.layers = nn.ModuleList(list(blocks[:layers]))
    base.norm = norm if adapter is None else nn.Sequential(adapter, norm)
    base.rotary_emb = rotary
    draft.set_output_embeddings(head)
    draft.generation_config = copy.deepcopy(target.generation_config)
    leftover = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftover:
        raise RuntimeError(f"self-draft left tensors unset: {leftover[:5]}")
    return draft.eval()


def new_exit_adapter(target, layers: int | None = None) -> ExitAdapter:
    """An untrained adapter for the output of layer `layers` (default: the last), on that layer's
    device (where its input comes from, when model.device_map spreads the layers) in the target's dtype."""
    _, blocks, norm, _, _ = _decoder_parts(target)
    adapter = ExitAdapter(copy.deepcopy(norm), target.config.get_text_config().hidden_size)
    ref = next(blocks[(layers or len(blocks)) - 1].parameters())
    return adapter.to(device=ref.device, dtype=target.dtype)


def save_adapter(adapter: ExitAdapter, path: str | Path, layers: int, info: dict) -> None:
    save_weights(adapter, path, ADAPTER_FORMAT,
                 {"layers": str(layers), "hidden_size": str(adapter.proj.weight.shape[0]), "info": json.dumps(info)})


def load_adapter(target, path: str | Path, layers: int) -> ExitAdapter:
    meta, state = load_weights(Path(path).expanduser(), ADAPTER_FORMAT, "draft.adapter", "exit adapter",
                               "train one with scripts/train_exit_adapter.py "
                               "or set draft.adapter=null for the plain truncation")
    adapter = new_exit_adapter(target, layers)
    trained = (meta_int(meta, "layers", "draft.adapter", path), meta_int(meta, "hidden_size", "draft.adapter", path))
    if trained != (layers, adapter.proj.weight.shape[0]):
        raise ValueError(f"draft.adapter: {path} was trained for {trained[0]} layers and hidden size {trained[1]}; "
                         f"this draft has {layers} layers and hidden size {adapter.proj.weight.shape[0]}")
    load_state(adapter, state, "draft.adapter", path, "an exit adapter of this shape")
    return adapter


@dataclass
class SelfDraft:
    """draft=self: the target's first `layers` layers + final norm + head (+ exit adapter)."""

    layers: int = 4
    adapter: str | None = None  # path to a trained exit adapter (safetensors); null = plain truncation

    def __post_init__(self):
        if not (isinstance(self.layers, int) and self.layers >= 1):
            raise ValueError(f"draft.layers must be an integer >= 1, got {self.layers!r}")

    @property
    def name(self) -> str:
        return f"self-{self.layers}" + ("+adapter" if self.adapter else "")

    def adapter_path(self) -> Path | None:
        """The adapter file: as given, or relative to the repository (the shipped adapters/)."""
        return addon_path(self.adapter) if self.adapter else None

    def build(self, target: LM) -> LM:
        check_layers(target.model, self.layers)
        adapter = load_adapter(target.model, self.adapter_path(), self.layers) if self.adapter else None
        model = self_draft_model(target.model, self.layers, adapter)
        # fast_path: the shared layers are already on the target's path; the adapter joins it.
        return LM(model, target.tokenizer, name=f"{target.name}/{self.name}", max_context=target.max_context,
                  fast_path=target.fast_path)


def check_same_vocabulary(target: LM, draft: LM) -> None:
    """Speculative decoding compares token ids: the two tokenizers must map text to the same ids."""
    t, d = target.tokenizer, draft.tokenizer
    if t is None or d is None:
        if target.vocab_size != draft.vocab_size:
            raise ValueError(f"draft {draft.name} has {draft.vocab_size} output tokens, "
                             f"target {target.name} {target.vocab_size}")
        return
    if t.get_vocab() != d.get_vocab():
        raise ValueError(f"draft {draft.name} does not share the target's tokenizer ({len(d)} vs {len(t)} tokens, "
                         f"different ids): speculative decoding needs the same vocabulary")
    if draft.vocab_size < len(t):
        raise ValueError(f"draft {draft.name}'s head covers {draft.vocab_size} ids, "
                         f"fewer than the tokenizer's {len(t)}")


@runtime_checkable
class ModelSpec(Protocol):
    """A model config (e.g. bench.models.PretrainedModel): a separate draft model."""

    def load(self) -> LM: ...


@runtime_checkable
class DraftSpec(Protocol):
    """A draft built from the target itself (SelfDraft)."""

    def build(self, target: LM) -> LM: ...


def draft_needs(spec) -> dict[str, str]:
    """What a draft-model decoder reads of its target through its draft (contract.target_needs): draft=self
    is cut from the target's own torch layers; a separate model reads nothing of it."""
    if isinstance(spec, DraftSpec) and not isinstance(spec, ModelSpec):
        return {"weights": "draft=self is cut from the target's own layers: give draft=<a GGUF model config>"}
    return {}


def build_draft(spec, target: LM) -> LM:
    """decoder.draft -> an LM: a model config, checked against the target's vocabulary, or a
    draft built from the target (draft=self)."""
    if isinstance(spec, ModelSpec):  # checked first: some model configs also have a build()
        draft = spec.load()
        check_same_vocabulary(target, draft)
        return draft
    if isinstance(spec, DraftSpec):
        return spec.build(target)
    raise ValueError(f"decoder.draft must be draft=self or a model config, got {type(spec).__name__}")
