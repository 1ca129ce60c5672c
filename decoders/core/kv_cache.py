"""The KV caches decoders edit, and the name a forward takes its cache by.

transformers' cache classes and their crop semantics live here and nowhere else.
"""
from __future__ import annotations

import bisect
import functools
import inspect
from typing import Sequence

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .transfer import to_device


def cache_kwarg(module: nn.Module) -> str:
    """The name `module.forward` takes its KV cache by: transformers 5.24 renamed past_key_values
    to cache (the old name warns, and generate() passes the new one)."""
    return _cache_kwarg(type(module))


@functools.cache
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def causal_mask(new: int, cached: int, device=None) -> torch.Tensor:
    """bool (new, cached + new): every new token sees the whole cache and the new tokens up to itself.
    On the host in numpy (slot j seen by row i where j <= cached + i): between forwards each torch
    operation costs several times a numpy one."""
    if device is None or torch.device(device).type == "cpu":
        return torch.from_numpy(np.arange(cached + new) <= np.arange(cached, cached + new)[:, None])
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


class SlabLayer(DynamicLayer):
    """One layer's keys and values as views of a KVSlab's first `length` positions. A new token's are
    written in place (DynamicLayer concatenates: a copy of the whole layer every forward)."""

    def __init__(self, slab: "KVSlab", index: int):  # not DynamicLayer's: keys and values are views here
        self.slab, self.index, self.length, self.is_initialized = slab, index, 0, False
        self.whole: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, H, capacity, D) each, set by the slab

    @property
    def keys(self) -> torch.Tensor | None:
        return self.whole[0].narrow(2, 0, self.length) if self.whole is not None else None

    @property
    def values(self) -> torch.Tensor | None:
        return self.whole[1].narrow(2, 0, self.length) if self.whole is not None else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.length, key_states.shape[-2]
        if self.whole is None or n + q > self.whole[0].shape[2]:
            self.slab.grow(key_states, n + q)
        keys, values = self.whole
        keys.narrow(2, n, q).copy_(key_states)
        values.narrow(2, n, q).copy_(value_states)
        self.length = n + q
        return keys.narrow(2, 0, n + q), values.narrow(2, 0, n + q)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count: the tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0


class KVSlab:
    """Every layer's keys and values in one tensor, (layers, 2, B, H, capacity, D), as gpt-fast's static
    cache keeps them: keeping a tree's accepted path is one copy for all layers (per layer and tensor,
    60 copies for SmolLM2: 0.35-0.44 ms a step), and a rollback sets lengths. Capacity is reserved for
    the generation (prompt + max_new_tokens + a step), grown by half when a forward needs more."""

    def __init__(self, layers: int, reserve: int = 0):
        self.layers = [SlabLayer(self, i) for i in range(layers)]
        self.reserve = reserve
        self.data: torch.Tensor | None = None

    def grow(self, like: torch.Tensor, needed: int) -> None:
        """Room for `needed` positions, laid out as `like` (B, H, q, D); what is held is kept."""
        old = self.data
        capacity = max(needed, self.reserve, 0 if old is None else old.shape[4] * 3 // 2)
        b, h, _, d = like.shape
        data = like.new_empty(len(self.layers), 2, b, h, capacity, d)
        if old is not None:
            if old.shape[2:4] + old.shape[5:] != (b, h, d):
                raise ValueError(f"KVSlab: every layer's keys must be (B, H, q, D) = {tuple(old.shape[2:4])} x "
                                 f"{old.shape[5]}; a layer gave {tuple(like.shape)}")
            held = max(layer.length for layer in self.layers)
            data.narrow(4, 0, held).copy_(old.narrow(4, 0, held))
        self.data = data
        for i, layer in enumerate(self.layers):
            layer.whole = (data[i, 0], data[i, 1])

    def keep(self, start: int, moved: Sequence[int]) -> None:
        """Positions start, start + 1, ... take those of `moved` (ascending, each >= its destination);
        every layer then holds start + len(moved) positions."""
        n = start + len(moved)
        if moved:
            src = torch.tensor(moved, dtype=torch.long).to(self.data.device, non_blocking=True)
            rows = self.data.view(-1, *self.data.shape[4:])  # (layers * 2 * B * H, capacity, D)
            # index_select copies first, so overlapping source and destination are safe (on the 6-D
            # slab itself it took 12 ms outside inference mode, against 5 us on this view)
            rows.narrow(1, start, len(moved)).copy_(rows.index_select(1, src))
        for layer in self.layers:
            layer.length = n


def full_history_cache(config) -> DynamicCache:
    """A DynamicCache for a model with this config whose every layer keeps the whole history: a sliding
    layer's window is applied by its mask (layer_types), so that crop and keep are one edit for all layers."""
    hf = DynamicCache(config=config)
    hf.layers = [DynamicLayer() for _ in hf.layers]
    return hf


class KVCache:
    """A transformers cache plus the two edits decoders need: crop (chain rollback) and keep (tree path).
    Every layer keeps the whole history (full_history_cache), in one KVSlab unless the forward is
    compiled or the layers are spread over devices; a draft's hand-made DynamicCache is edited layer by
    layer. Where a model has sliding-window layers, the cache also keeps each slot's token position
    (`positions`): their masks compare positions, and a draft's cache may hold a tree's nodes."""

    def __init__(self, hf_cache: DynamicCache, contiguous: bool = False, slab: KVSlab | None = None,
                 positions: bool = False):
        self.hf = hf_cache
        self.slab = slab
        # A compiled forward (model.compile) guards on the cache tensors' strides: a cropped view would
        # recompile it, so edits leave the tensors contiguous (one copy of the kept positions).
        self.contiguous = contiguous
        self.positions = torch.zeros(0, dtype=torch.long) if positions else None  # (len(self),) on the host

    @classmethod
    def for_model(cls, config, reserve: int = 0, slab: bool = True, contiguous: bool = False,
                  positions: bool = False) -> "KVCache":
        """A cache for a model with this config: in a KVSlab of `reserve` positions where `slab` allows it,
        else a DynamicCache; `positions`: keep each slot's token position."""
        hf = full_history_cache(config)
        if not slab or contiguous:
            return cls(hf, contiguous=contiguous, positions=positions)
        layers = KVSlab(len(hf.layers), reserve)
        hf.layers = layers.layers
        return cls(hf, slab=layers, positions=positions)

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def fed(self, positions: torch.Tensor) -> None:
        """A forward appends tokens at these positions (1D): noted where positions are kept, on the
        positions' device (a tree's on a GPU are never read by the host)."""
        if self.positions is not None:
            self.positions = torch.cat([self.positions.to(positions.device), positions])

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
        if self.positions is not None:
            self.positions = self.positions[:length]

    def _make_contiguous(self) -> None:
        if self.contiguous:
            for layer in self.hf.layers:
                if getattr(layer, "is_initialized", False):
                    layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()

    @torch.inference_mode()
    def keep(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the positions `indices` (ascending), in that order: e.g. prefix + accepted path."""
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        n = len(indices)
        if n > len(self):
            raise ValueError(f"cannot keep {n} positions of a cache of {len(self)}")
        # Ascending and distinct, so indices[i] >= i, and once one has moved every later one has:
        # the first that moves is found by bisection.
        start = bisect.bisect_left(range(n), True, key=lambda i: indices[i] != i)
        if start == n:  # a prefix (a chain's accepted path): crop, which every cache layer type supports
            return self._crop(n)
        tail = indices[start:]
        if self.positions is not None:  # the moved ones only: the context's length is no step's work
            self.positions = torch.cat([self.positions[:start],
                                        self.positions[to_device(tail, self.positions.device, torch.long)]])
        if self.slab is not None:
            return self.slab.keep(start, tail)
        moved = torch.tensor(tail, dtype=torch.long)
        for layer in self.hf.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError("KVCache.keep edits caches whose layers keep the whole history "
                                          f"(DynamicLayer), not {type(layer).__name__}")
            if not layer.is_initialized:
                continue
            src = moved.to(layer.keys.device)
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

    def positions(self) -> torch.Tensor:
        """(B, slots): each slot's token position in its row (a row's valid slots hold its tokens in order;
        an invalid slot's is never read, the mask hides it)."""
        return self.valid.cumsum(1) - 1

    def _layers(self):
        for layer in self.hf.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError("batched decoding edits caches whose layers keep the whole history "
                                          f"(DynamicLayer), not {type(layer).__name__}")
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

