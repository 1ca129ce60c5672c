"""Which keys each layer of a model attends to, and the masks that say it.

transformers names each decoder layer's attention by a layer type (`cache_utils.get_layer_types_and_kwargs`
reads them off any config): "full_attention" sees the whole context, "sliding_attention" the last
`sliding_window` positions (a query at position p sees keys at positions p - window + 1 .. p). The
harness handles these two. Every layer's cache keeps the whole history (kv_cache.KVCache), so that
keeping a tree's accepted path or rolling back a chain is the same edit on every layer; a sliding
layer's window is applied by its mask instead. The cost is memory: a sliding layer holds the whole
context rather than its window (models.kv_cache_bytes counts it so).

A custom mask (a tree, lookahead's window, batch rows) is built once over the fed tokens and then
narrowed per layer type by key and query positions. A model whose layers are all of one type takes
one mask; one that mixes types (Gemma 2 / 3, GPT-OSS, Cohere 2) takes a dict keyed by type, which
its forward uses as it is.
"""
from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED = ("full_attention", "sliding_attention")


class UnsupportedAttention(ValueError):
    """A model whose layers attend in a way the harness's caches and masks do not handle."""


@dataclass(frozen=True)
class AttentionPattern:
    """Per decoder layer: its type, and its window (None: the whole context)."""

    types: tuple[str, ...]
    windows: tuple[int | None, ...]

    @classmethod
    def of(cls, config) -> "AttentionPattern":
        """The pattern of a model with this config; UnsupportedAttention names the model type and what
        is supported when a layer attends otherwise (chunked, linear or shared-cache layers, ...)."""
        from transformers.cache_utils import get_layer_types_and_kwargs

        cfg = config.get_text_config()
        name = getattr(cfg, "model_type", None) or type(cfg).__name__
        allowed = f"the harness decodes models whose layers are {' or '.join(SUPPORTED)}"
        try:
            types, kwargs = get_layer_types_and_kwargs(cfg)
        except Exception as e:  # e.g. layers sharing another layer's cache, which transformers cannot type
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UnsupportedAttention(f"model type {name!r}: its layers' attention is not one transformers types "
                                       f"({why}); {allowed}") from None
        other = sorted(set(types) - set(SUPPORTED))
        if other:
            raise UnsupportedAttention(f"model type {name!r} has {', '.join(other)} layers; {allowed}")
        windows = tuple(kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(types, kwargs))
        if any(t == "sliding_attention" and not (isinstance(w, int) and w >= 1) for t, w in zip(types, windows)):
            raise UnsupportedAttention(f"model type {name!r}: a sliding_attention layer "
                                       f"without a positive integer sliding_window ({windows})")
        return cls(tuple(types), windows)

    @property
    def sliding(self) -> bool:
        """Whether any layer sees less than the whole context."""
        return any(w is not None for w in self.windows)

    @property
    def mixed(self) -> bool:
        """Whether layers of different types (or windows) share the model: its forward takes a mask per type."""
        return len(set(zip(self.types, self.windows))) > 1

    def by_type(self) -> dict[str, int | None]:
        """Each layer type present, with its window."""
        return dict(zip(self.types, self.windows))

    def describe(self) -> str:
        """One phrase for records and errors: e.g. "15 sliding_attention (window 512) + 3 full_attention"."""
        parts = []
        for kind, window in self.by_type().items():
            n = sum(t == kind for t in self.types)
            parts.append(f"{n} {kind}" + (f" (window {window})" if window is not None else ""))
        return " + ".join(parts)

    def masks(self, allowed, query_positions, key_positions):
        """`allowed` (..., q, k) bool, True where a query may attend, narrowed per layer type: a sliding
        layer's query at position p also needs its key at a position above p - window. query_positions
        (..., q) and key_positions (..., k) are token positions (not cache slots). Torch tensors, or numpy
        arrays (on the host each operation costs a fraction of torch's). One mask for a model of one layer
        type, else {layer type: mask}."""
        out = {}
        for kind, window in self._by_type:
            if window is None:
                out[kind] = allowed
            else:
                near = key_positions[..., None, :] > query_positions[..., :, None] - window  # (..., q, k)
                out[kind] = allowed & (near.to(allowed.device) if isinstance(near, torch.Tensor) else near)
        return out if self.mixed else next(iter(out.values()))

    @functools.cached_property
    def _by_type(self) -> tuple[tuple[str, int | None], ...]:
        return tuple(self.by_type().items())


def rotary_embeddings(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor, layer_type: str):
    """(cos, sin) of a model's rotary embedding for a layer of `layer_type`: a model that keeps a table
    per layer type (Gemma 3: a local base for sliding layers, a global one for full) takes the type."""
    if _takes_layer_type(type(rotary)):
        return rotary(x, positions, layer_type)
    return rotary(x, positions)


@functools.cache
def _takes_layer_type(cls: type) -> bool:
    return "layer_type" in inspect.signature(cls.forward).parameters


def full_attention_config(config):
    """A copy of a decoder config whose layers all attend to the whole context (a draft's layer of the
    target's class: the draft's masks are its own, and its rotary is the full-attention layers')."""
    cfg = copy.deepcopy(config)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = ["full_attention"] * len(cfg.layer_types)
    elif getattr(cfg, "sliding_window", None) is not None:
        cfg.sliding_window = None
    return cfg
