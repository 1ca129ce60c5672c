"""The KV caches decoders edit, and the name a forward takes its cache by.

transformers' cache classes and their crop semantics live here and nowhere else.
"""
from __future__ import annotations

import functools
import inspect
from typing import Sequence

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def cache_kwarg(module: nn.Module) -> str:
    """The name `module.forward` takes its KV cache by: transformers 5.24 renamed past_key_values
    to cache (the old name warns, and generate() passes the new one)."""
    return _cache_kwarg(type(module))


@functools.cache
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def causal_mask(new: int, cached: int, device=None) -> torch.Tensor:
    """bool (new, cached + new): every new token sees the whole cache and the new tokens up to itself."""
    return torch.ones(new, cached + new, dtype=torch.bool, device=device).tril(cached)


def level_mask(cached: int, prefix: int, ancestors: list[list[int]]) -> torch.Tensor:
    """bool (rows, cached + rows): one level of a tree fed to a draft's cache, a row per node. Each
    row sees the committed text (cache slots below `prefix`), its own fed ancestors (their slots,
    `ancestors[row]`) and itself; not its siblings, nor other branches' nodes."""
    rows = len(ancestors)
    mask = torch.zeros(rows, cached + rows, dtype=torch.bool)
    mask[:, :prefix] = True
    for row, slots in enumerate(ancestors):
        mask[row, slots] = True
        mask[row, cached + row] = True
    return mask


def passed_cache(kwargs: dict):
    """The cache a forward hook's kwargs carry, under either name."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


class KVCache:
    """A DynamicCache plus the two edits decoders need: crop (chain rollback) and keep (tree path)."""

    def __init__(self, hf_cache: DynamicCache, contiguous: bool = False):
        self.hf = hf_cache
        # A compiled forward (model.compile) guards on the cache tensors' strides: a cropped view would
        # recompile it, so edits leave the tensors contiguous (one copy of the kept positions).
        self.contiguous = contiguous

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    @torch.inference_mode()
    def crop(self, length: int) -> None:
        """Keep the first `length` positions."""
        self._crop(length)

    def _crop(self, length: int) -> None:
        remove = len(self) - length
        if remove < 0:
            raise ValueError(f"cannot crop a cache of {len(self)} positions to {length}")
        if remove:
            self.hf.crop(-remove)  # transformers 5: a negative count removes that many
            self._make_contiguous()

    def _make_contiguous(self) -> None:
        if self.contiguous:
            for layer in self.hf.layers:
                if getattr(layer, "is_initialized", False):
                    layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()

    @torch.inference_mode()
    def keep(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the positions `indices` (ascending), in that order: e.g. prefix + accepted path."""
        if not isinstance(indices, torch.Tensor) and (not indices or indices[-1] == len(indices) - 1):
            return self._crop(len(indices))  # ascending up to n - 1: the first n, a chain's accepted path
        idx = torch.as_tensor(indices, dtype=torch.long)
        n = len(idx)
        # Positions already in place need no copy: find the first one that moves.
        moved = torch.nonzero(idx != torch.arange(n), as_tuple=False)
        start = int(moved[0]) if len(moved) else n
        if start == n:  # a prefix (a chain's accepted path): crop, which every cache layer type supports
            return self._crop(n)
        for layer in self.hf.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError("KVCache.keep supports full-attention DynamicLayer only, "
                                          f"not {type(layer).__name__}")
            if not layer.is_initialized:
                continue
            if start < n:
                src = idx[start:].to(layer.keys.device)
                # Advanced indexing copies first, so overlapping source and destination are safe.
                layer.keys[..., start:n, :] = layer.keys[..., src, :]
                layer.values[..., start:n, :] = layer.values[..., src, :]
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]
        self._make_contiguous()


class BatchKVCache:
    """A DynamicCache over B rows, and which of its slots each row may attend to (`valid`, (B, slots)).

    Every forward appends the same number of slots to every row (the batch's widest feed); each row
    then keeps its own committed tokens among them (keep_tail), and what it does not keep, or never
    fed (padding), stays behind as an invalid slot that the mask hides. When invalid slots are a
    quarter of the cache, rows are compacted to the left (one copy, as a DynamicCache append makes)."""

    def __init__(self, hf_cache: DynamicCache, rows: int):
        self.hf = hf_cache
        self.valid = torch.zeros(rows, 0, dtype=torch.bool)

    def __len__(self) -> int:
        """Slots per row (valid or not)."""
        return self.valid.shape[1]

    def lengths(self) -> list[int]:
        """Tokens each row holds: its positions run 0 .. length - 1."""
        return self.valid.sum(1).tolist()

    def _layers(self):
        for layer in self.hf.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError("batched decoding supports full-attention DynamicLayer only, "
                                          f"not {type(layer).__name__}")
            if layer.is_initialized:
                yield layer

    @torch.inference_mode()
    def select_rows(self, rows: Sequence[int]) -> None:
        """Keep only these batch rows (finished rows leave the batch)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        self.hf.batch_select_indices(idx.to(self.hf.layers[0].keys.device) if self.hf.layers[0].is_initialized else idx)
        self.valid = self.valid[idx]

    @torch.inference_mode()
    def keep_tail(self, start: int, kept: Sequence[Sequence[int]]) -> None:
        """Of the slots from `start` on (the last forward's), row r keeps kept[r] (ascending offsets
        from `start`), moved to start, start + 1, ...; the rest of the tail becomes invalid."""
        width = max(map(len, kept), default=0)
        if 0 < width == len(self) - start and all(len(k) == width and k[-1] == width - 1 for k in kept):
            # Every row keeps the whole tail in place (autoregressive; chains all fully accepted, none
            # padded): nothing moves or is cut, and the tail is all valid already. Batched
            # autoregressive spent 0.65 ms a step outside the forward at B = 4 with the general path, 0.41 without.
            return
        index = torch.zeros(len(kept), width, dtype=torch.long)
        tail = torch.zeros(len(kept), width, dtype=torch.bool)
        for r, offsets in enumerate(kept):
            index[r, :len(offsets)] = torch.as_tensor(list(offsets), dtype=torch.long)
            tail[r, :len(offsets)] = True
        moves = not torch.equal(index[tail], torch.arange(width).expand_as(index)[tail])
        for layer in self._layers():
            if moves:
                at = (index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                      .to(layer.keys.device))
                # gather copies first, so overlapping source and destination are safe
                layer.keys[:, :, start:start + width] = layer.keys[:, :, start:].gather(2, at)
                layer.values[:, :, start:start + width] = layer.values[:, :, start:].gather(2, at)
            layer.keys = layer.keys[:, :, :start + width]
            layer.values = layer.values[:, :, :start + width]
        self.valid = torch.cat([self.valid[:, :start], tail], dim=1)
        if 4 * (len(self) - max(self.lengths(), default=0)) >= len(self) > 0:  # compacting frees a quarter
            self._compact()

    def _compact(self) -> None:
        """Move every row's valid slots to the front, in order; cut the slots no row uses."""
        lengths = self.valid.sum(1)
        width = int(lengths.max())
        # Stable sort puts each row's valid slots first, in their order.
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
        for layer in self._layers():
            at = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]).to(layer.keys.device)
            layer.keys = layer.keys.gather(2, at)
            layer.values = layer.values.gather(2, at)
        self.valid = torch.arange(width)[None, :] < lengths[:, None]

