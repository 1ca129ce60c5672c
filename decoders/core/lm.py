"""The thin wrapper every decoder talks to instead of transformers.

transformers' API details (cache classes and their crop semantics, 4D-mask formats per
attention implementation, generate()'s config merging) live here and nowhere else.
"""
from __future__ import annotations

import functools
import inspect
import time
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer
from transformers.generation.streamers import BaseStreamer

from .sampling import Sampling
from .trace import Generation, Step, stop_reason, truncate_at_stop


def cache_kwarg(module: nn.Module) -> str:
    """The name `module.forward` takes its KV cache by: transformers 5.24 renamed past_key_values
    to cache (the old name warns, and generate() passes the new one)."""
    return _cache_kwarg(type(module))


@functools.cache
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def passed_cache(kwargs: dict):
    """The cache a forward hook's kwargs carry, under either name."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def forward_flops(spec: dict, tokens: int, context: int) -> float:
    """FLOPs of one forward of `tokens` new tokens after `context` cached ones (spec: LM.flops_spec())."""
    dense = 2.0 * spec["matmul_params"] * tokens
    attended = tokens * context + tokens * (tokens + 1) / 2
    return dense + 4.0 * spec["n_layers"] * spec["d_attn"] * attended


class KVCache:
    """A DynamicCache plus the two edits decoders need: crop (chain rollback) and keep (tree path)."""

    def __init__(self, hf_cache: DynamicCache):
        self.hf = hf_cache

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

    @torch.inference_mode()
    def keep(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Keep only the positions `indices` (ascending), in that order: e.g. prefix + accepted path."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        n = len(idx)
        # Positions already in place need no copy: find the first one that moves.
        moved = torch.nonzero(idx != torch.arange(n), as_tuple=False)
        start = int(moved[0]) if len(moved) else n
        if start == n:  # a prefix (a chain's accepted path): crop, which every cache layer type supports
            return self._crop(n)
        for layer in self.hf.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(f"KVCache.keep supports full-attention DynamicLayer only, not {type(layer).__name__}")
            if not layer.is_initialized:
                continue
            if start < n:
                src = idx[start:].to(layer.keys.device)
                # Advanced indexing copies first, so overlapping source and destination are safe.
                layer.keys[..., start:n, :] = layer.keys[..., src, :]
                layer.values[..., start:n, :] = layer.values[..., src, :]
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]



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
                raise NotImplementedError(f"batched decoding supports full-attention DynamicLayer only, not {type(layer).__name__}")
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
                at = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]).to(layer.keys.device)
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


# ---- the fast forward path -------------------------------------------------------------
# On CPU, nn.Linear's default kernels make a k-row forward cost ~2x a 1-row one (k = 8..16, fp32)
# although both read the same weights once. oneDNN's prepacked weights (the kernels torch.compile's
# CPU freezing emits) are cheaper from a few rows up in fp32, and in bfloat16 (AMX) at every size,
# the 1-row step included. Where the packed kernel starts to win depends on the CPU (4 rows on a
# Sapphire Rapids Xeon, 1 row on a Zen 5 EPYC: results/reference/fast_path/README.md), so below
# `min_rows` the native kernel is kept; these are the defaults, and model.fast_path=auto measures it.
FAST_PATHS = ("none", "prepacked")
PACKED_MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1}


class PrepackedLinear(nn.Linear):
    """An nn.Linear (the same module, its class swapped: parameters, tying, hooks and sharing
    with self-drafts stay as they are) that keeps a oneDNN-packed copy of its weight for inputs
    of `_min_rows` rows or more. The copy is rebuilt when the weight changes (training, .to())."""

    _min_rows = 1 << 30  # set by _prepack

    def _pack(self):
        # Called on every multi-row forward: the check allocates nothing; detach() only to repack.
        weight = self.weight
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor (made under inference_mode) cannot change in place
            version = 0
        key = (weight.data_ptr(), weight.dtype, version)
        if self.__dict__.get("_packed_key") != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (rows < self._min_rows or x.dtype != self.weight.dtype
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._pack(), self.bias, "none", [], "")


def _prepack(model: nn.Module, min_rows: int) -> int:
    """Swap every plain nn.Linear of `model` to PrepackedLinear, packed from `min_rows` rows up;
    returns the bytes of the packed copies it made (modules already swapped, e.g. shared with a
    self-draft's target, cost nothing but take the new threshold)."""
    extra = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PrepackedLinear
            extra += module._pack().numel() * module.weight.element_size()
        if type(module) is PrepackedLinear:
            module._min_rows = min_rows
    return extra


def _unpack(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is PrepackedLinear:
            module.__class__ = nn.Linear
            for attr in ("_packed", "_packed_key", "_min_rows"):
                module.__dict__.pop(attr, None)


def prepacked_supported(model: nn.Module) -> str | None:
    """None if the prepacked path runs here, else why not (private ops: checked, not assumed)."""
    ref = model.get_input_embeddings().weight
    if ref.device.type != "cpu":
        return f"prepacked linears are a CPU path; this model is on {ref.device.type}"
    if ref.dtype not in (torch.float32, torch.bfloat16):
        return f"prepacked linears support float32 and bfloat16, not {str(ref.dtype).replace('torch.', '')}"
    try:
        if not torch.backends.mkldnn.is_available():
            return "this torch build has no oneDNN (mkldnn)"
        probe = torch.ones(3, 4, dtype=ref.dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4, dtype=ref.dtype), packed, None, "none", [], "")
        if out.shape != (2, 3) or not torch.allclose(out.float(), torch.full((2, 3), 4.0)):
            return "the oneDNN linear gave a wrong result on a probe"
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        return f"the oneDNN linear ops are unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


class LM:
    """A HF causal LM, its tokenizer, and what metrics need to know about it."""

    def __init__(self, model, tokenizer=None, name: str = "model", max_context: int | None = None,
                 fast_path: str = "none"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        # The one placement rule (add-ons and per-step tensors follow it): inputs go to `device`, the
        # embedding's; logits, hidden states and features come out on `output_device`, the head's
        # (the same device unless model.device_map spread the layers). `dtype` is the weights' dtype.
        self.device = model.get_input_embeddings().weight.device
        self.output_device = model.get_output_embeddings().weight.device
        self.dtype = model.dtype
        self.cuda_devices = sorted({p.device for p in model.parameters() if p.device.type == "cuda"},
                                   key=lambda d: d.index or 0)
        self.attn_implementation = model.config._attn_implementation
        self.cache_kw = cache_kwarg(model)
        self.max_context = max_context or getattr(self.config, "max_position_embeddings", None)
        self.stop_ids = self._stop_ids()
        self._hidden: torch.Tensor | None = None
        self._want_hidden = False
        self._features: torch.Tensor | None = None
        self._flops_spec: dict | None = None
        model.base_model.register_forward_hook(self._capture_hidden)
        # A model whose modules are shared with an LM already on the fast path (a self-draft) is on it too.
        packed = [m for m in model.modules() if type(m) is PrepackedLinear]
        self.fast_path = "prepacked" if packed else "none"
        self.packed_min_rows = packed[0]._min_rows if packed else None  # rows from which "prepacked" packs
        self.fast_path_note = ""  # why the path in use differs from the one asked for, if it does
        self.fast_path_bytes = 0  # memory the fast path holds beyond the model's own weights
        if fast_path != self.fast_path or fast_path == "prepacked":  # packs what is not packed yet
            self.set_fast_path(fast_path, self.packed_min_rows)

    # ---- fast forward path ------------------------------------------------------------------
    def set_fast_path(self, path: str, min_rows: int | None = None) -> str:
        """Switch the kernel path of every linear layer: "none" (transformers' own) or
        "prepacked" (oneDNN-packed weights for inputs of `min_rows` rows or more, CPU; default
        PACKED_MIN_ROWS for the dtype). A path this machine cannot run falls back to "none",
        with the reason in fast_path_note. Returns the path in use."""
        if path not in FAST_PATHS:
            raise ValueError(f"fast path {path!r} is not one of {', '.join(FAST_PATHS)}")
        if min_rows is not None and (not isinstance(min_rows, int) or min_rows < 1):
            raise ValueError(f"packed min_rows must be an integer >= 1, not {min_rows!r}")
        self.fast_path_note = ""
        if path == "none":
            _unpack(self.model)
            self.fast_path, self.fast_path_bytes, self.packed_min_rows = "none", 0, None
        else:
            why_not = prepacked_supported(self.model)
            if why_not:
                self.fast_path_note = f"prepacked unavailable: {why_not}"
            else:
                self.packed_min_rows = min_rows or PACKED_MIN_ROWS.get(self.dtype, 1)
                self.fast_path_bytes += _prepack(self.model, self.packed_min_rows)
                self.fast_path = "prepacked"
        return self.fast_path

    def accelerate(self, module: nn.Module) -> nn.Module:
        """Put an add-on that runs beside the model (Medusa heads, a feature draft) on the same path."""
        if self.fast_path == "prepacked":
            self.fast_path_bytes += _prepack(module, self.packed_min_rows)
        return module

    # ---- what metrics need -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def flops_spec(self) -> dict:
        """Parameters doing matmul work per token (all but the input-embedding lookup; a tied
        output head is a matmul and counts), layers, and attention width. Computed once."""
        if self._flops_spec is None:
            unique = {p.data_ptr(): p.numel() for p in self.model.parameters()}
            emb = self.model.get_input_embeddings().weight
            head = self.model.get_output_embeddings().weight
            matmul = sum(unique.values()) - emb.numel() + (head.numel() if head.data_ptr() == emb.data_ptr() else 0)
            cfg = self.config.get_text_config()
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self._flops_spec = {"matmul_params": int(matmul), "n_layers": int(cfg.num_hidden_layers),
                                "d_attn": int(cfg.num_attention_heads * head_dim)}
        return dict(self._flops_spec)

    def _stop_ids(self) -> frozenset[int]:
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if eos is not None:
                ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return frozenset(int(i) for i in ids)

    def device_map(self) -> dict[str, int]:
        """Where the model's modules are (device -> number of modules), for provenance: accelerate's
        device_map when one placed the model (its "cpu" / "disk" entries are offloaded), else the
        modules holding parameters, by their parameters' device."""
        where: dict[str, int] = {}
        placed = getattr(self.model, "hf_device_map", None)
        if placed:
            for device in placed.values():
                key = f"cuda:{device}" if isinstance(device, int) else str(device)
                where[key] = where.get(key, 0) + 1
            return where
        for module in self.model.modules():
            own = next(module.parameters(recurse=False), None)
            if own is not None:
                where[str(own.device)] = where.get(str(own.device), 0) + 1
        return where

    def sync(self) -> None:
        """Wait for every CUDA device the model runs on (a timer read before that would stop early)."""
        for device in self.cuda_devices:
            torch.cuda.synchronize(device)

    # ---- forward ------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return KVCache(DynamicCache(config=self.config))

    def _capture_hidden(self, module, args, output):
        if self._want_hidden:
            self._hidden = output.last_hidden_state

    def _capture_features(self, module, args):
        self._features = args[0]

    def _hook_features(self, features: bool | tuple[int, ...]) -> list:
        """Hooks, for one call only, that leave in self._features what `features` asks for: True, the
        final norm's input; layer indices, those layers' inputs concatenated (assembled when the final
        norm is reached, after every layer has run)."""
        if not features:
            return []
        if features is True:
            return [self.final_norm.register_forward_pre_hook(self._capture_features)]
        layers, parts = self.model.base_model.layers, {}

        def grab(i):
            return lambda module, args, kwargs: parts.__setitem__(i, args[0] if args else kwargs["hidden_states"])

        def assemble(module, args):
            self._features = torch.cat([parts[i] for i in features], -1)

        hooks = [layers[i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in sorted(set(features))]
        return hooks + [self.final_norm.register_forward_pre_hook(assemble)]

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last layer and the output head (features -> hidden state)."""
        norm = getattr(self.model.base_model, "norm", None)
        if not isinstance(norm, nn.Module):
            raise ValueError(f"{self.name}: no final norm found at model.base_model.norm")
        return norm

    def mask_4d(self, mask: torch.Tensor) -> torch.Tensor:
        """A bool (q, k) mask (True: may attend) in the form this model's attention takes, (1, 1, q, k)."""
        mask = mask.to(self.device)[None, None]
        if self.attn_implementation == "sdpa":
            return mask
        if self.attn_implementation == "eager":
            return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(~mask, torch.finfo(self.dtype).min)
        raise ValueError(f"custom attention masks need attn_implementation 'sdpa' or 'eager', not {self.attn_implementation!r}")

    @torch.inference_mode()
    def forward(self, input_ids, cache: KVCache, position_ids=None, mask: torch.Tensor | None = None,
                last_only: bool = False, hidden: bool = False, logits_last: int | None = None,
                logits_rows: Sequence[int] | None = None, features: bool | tuple[int, ...] = False):
        """Feed new tokens after the cache; they are appended to it.

        input_ids: 1D ids (list or tensor). position_ids: 1D, default cache length onward.
        mask: bool (q, len(cache) + q), True where a new token may attend; None = causal.
        Returns logits (q, V) (only the last row's if last_only; the last `logits_last` rows'
        if given: a prefill fused with drafts needs no logits for the prompt; only rows
        `logits_rows`, in that order, if given), and the last hidden state of the same rows
        too when hidden=True. Rows left out skip the vocabulary projection. features=True returns
        instead (logits, features of every fed row): the last layer's output before the final
        norm (EAGLE's draft reads and predicts these); features=(i, j, ...): the inputs of those
        layers, concatenated in that order (EAGLE-3's fused low / mid / high features).
        """
        if hidden and features:
            raise ValueError("ask for hidden or features, not both")
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        kwargs = {}
        if position_ids is not None:
            kwargs["position_ids"] = torch.as_tensor(position_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        if mask is not None:
            if mask.shape != (ids.shape[1], len(cache) + ids.shape[1]):
                raise ValueError(f"mask shape {tuple(mask.shape)} != (new, cache + new) = {(ids.shape[1], len(cache) + ids.shape[1])}")
            kwargs["attention_mask"] = self.mask_4d(mask)
            if position_ids is None:
                raise ValueError("a custom mask needs explicit position_ids")
        if last_only:
            logits_last = 1
        if logits_last is not None:
            kwargs["logits_to_keep"] = int(logits_last)
        if logits_rows is not None:
            # it indexes the last hidden state, which is on the head's side
            kwargs["logits_to_keep"] = torch.as_tensor(logits_rows, dtype=torch.long, device=self.output_device)
        self._want_hidden = hidden
        # Hooked for this call only: a permanent hook would tie the norm to this wrapper (a deepcopy
        # of the norm, as a self-draft's exit adapter makes, would copy the whole model).
        handles = self._hook_features(features)
        try:
            out = self.model(input_ids=ids, **{self.cache_kw: cache.hf}, use_cache=True, **kwargs)
        finally:
            self._want_hidden = False
            for handle in handles:
                handle.remove()
        logits = out.logits[0]
        if features:
            f, self._features = self._features[0].to(self.output_device), None
            return logits, f
        if hidden:
            h = self._hidden[0].to(self.output_device)
            self._hidden = None
            if logits_rows is not None:
                return logits, h[kwargs["logits_to_keep"]]
            return logits, (h[-logits_last:] if logits_last is not None else h)
        return logits

    def new_batch_cache(self, rows: int) -> BatchKVCache:
        return BatchKVCache(DynamicCache(config=self.config), rows)

    @torch.inference_mode()
    def forward_batch(self, feeds: Sequence[Sequence[int]], cache: BatchKVCache, positions: Sequence[torch.Tensor],
                      masks: Sequence[torch.Tensor | None], rows: Sequence[Sequence[int]], hidden: bool = False,
                      features: bool | tuple[int, ...] = False) -> list[tuple]:
        """One forward over B rows, each feeding its own tokens after its own cached ones.

        feeds[r]: row r's new token ids; positions[r] their positions; masks[r] a bool (q_r, q_r) mask
        among them (None = causal); every new token sees all of row r's valid cache slots. Shorter feeds
        are padded on the left to the widest (a padding token sees only itself and is never valid
        afterwards): row r's token i lands in slot len(cache) + (widest - q_r) + i.
        rows[r]: the rows whose logits row r wants, in that order. Returns per row (logits, extra):
        extra is the last hidden state of the same rows (hidden=True), the features (pre-norm) of all
        its fed rows (features=True), else None."""
        if hidden and features:
            raise ValueError("ask for hidden or features, not both")
        width = max(map(len, feeds))
        # Feeds are right-aligned: every row's last token sits in the last column, so the rows whose
        # logits are wanted (a tree's last n, autoregressive's last one) share few columns.
        offsets = [width - len(feed) for feed in feeds]
        ids = torch.tensor([[0] * o + list(feed) for o, feed in zip(offsets, feeds)], dtype=torch.long)
        pos = torch.tensor([[0] * o + [int(x) for x in p] for o, p in zip(offsets, positions)], dtype=torch.long)
        real = torch.arange(width)[None, :] >= torch.tensor(offsets)[:, None]  # (b, width): not padding
        # Real tokens see their row's valid cache slots and (by default causally) its real new tokens;
        # a padding token sees only itself, so no softmax row is empty.
        new = torch.where(real[:, :, None], torch.tril(torch.ones(width, width, dtype=torch.bool)) & real[:, None, :],
                          torch.eye(width, dtype=torch.bool))
        for r, (m, o) in enumerate(zip(masks, offsets)):
            if m is not None:
                new[r, o:, o:] = m
        mask = torch.cat([cache.valid[:, None, :] & real[:, :, None], new], dim=2)[:, None]
        columns = sorted({o + i for o, want in zip(offsets, rows) for i in want})
        at = {col: j for j, col in enumerate(columns)}
        if columns == list(range(width - len(columns), width)):
            keep = len(columns)  # a suffix: transformers slices, no gather
        else:
            keep = torch.as_tensor(columns, dtype=torch.long, device=self.output_device)
        if self.attn_implementation == "eager":
            mask = torch.zeros(mask.shape, dtype=self.dtype).masked_fill(~mask, torch.finfo(self.dtype).min)
        elif self.attn_implementation != "sdpa":
            raise ValueError(f"batched decoding needs attn_implementation 'sdpa' or 'eager', not {self.attn_implementation!r}")
        self._want_hidden = hidden
        handles = self._hook_features(features)
        try:
            out = self.model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), attention_mask=mask.to(self.device),
                             **{self.cache_kw: cache.hf}, use_cache=True, logits_to_keep=keep)
            h, f = (x.to(self.output_device) if x is not None else None for x in (self._hidden, self._features))
        finally:
            self._want_hidden, self._hidden, self._features = False, None, None
            for handle in handles:
                handle.remove()
        cache.valid = torch.cat([cache.valid, real], 1)
        results = []
        for r, (want, o) in enumerate(zip(rows, offsets)):
            logits = out.logits[r, [at[o + i] for i in want]]
            extra = h[r, [o + i for i in want]] if hidden else f[r, o:] if features else None
            results.append((logits, extra))
        return results

    # ---- transformers' own generate(), traced -------------------------------------------
    @torch.inference_mode()
    def hf_generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                    stop_ids, assistant: "LM | None" = None, **generate_kwargs) -> Generation:
        """Run model.generate() and recover the DESIGN trace: one Step per target forward
        (forward hooks), tokens committed per step (the streamer is called once per step
        with exactly the tokens that step committed). With an assistant (assisted
        generation with the draft LM `assistant`), its forwards are charged to the next target step
        as draft time, tokens and FLOPs; its first pass over the prompt as draft_prefill_flops."""
        steps: list[Step] = []
        pending: dict = {}
        drafted = {"time": 0.0, "tokens": 0, "flops": 0.0, "prefill": 0.0}
        assistant_model = assistant.model if assistant is not None else None
        draft_spec = assistant.flops_spec() if assistant is not None else None
        if not sampling.greedy:  # generate() draws from the device's global RNG; seed it before the clock starts
            if self.device.type == "cuda":
                torch.cuda.manual_seed_all(sampling.seed)  # it draws on the head's GPU, which a device_map may make another one
            else:
                torch.default_generator.manual_seed(sampling.seed)
        self.sync()
        start = time.perf_counter()

        def pre_hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = passed_cache(kwargs)
            self.sync()  # generate()'s own work before this forward is overhead, not target time
            pending.update(t0=time.perf_counter(), tokens=int(ids.shape[-1]),
                           context=cache.get_seq_length() if cache is not None else 0)

        def post_hook(module, args, kwargs, output):
            self.sync()
            steps.append(Step(committed=0, forward_tokens=pending["tokens"], context_tokens=pending["context"],
                              target_time=time.perf_counter() - pending["t0"], draft_time=drafted["time"],
                              draft_forward_tokens=drafted["tokens"], draft_flops=drafted["flops"],
                              draft_prefill_flops=drafted["prefill"]))
            drafted.update(time=0.0, tokens=0, flops=0.0, prefill=0.0)

        def draft_pre_hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = passed_cache(kwargs)
            self.sync()
            drafted["t0"] = time.perf_counter()
            n = int(ids.shape[-1]) if ids is not None else 0
            context = cache.get_seq_length() if cache is not None else 0
            drafted["tokens"] += n
            drafted["flops"] += forward_flops(draft_spec, n, context)
            if context == 0:  # the assistant's first pass reads the prompt: its prefill
                drafted["prefill"] += forward_flops(draft_spec, min(n, len(prompt_ids)), 0)

        def draft_post_hook(module, args, kwargs, output):
            self.sync()
            drafted["time"] += time.perf_counter() - drafted.pop("t0")

        streamer = _StepStreamer(steps)
        config = self._generation_config(max_new_tokens, sampling, stop_ids, **generate_kwargs)
        handles = [self.model.register_forward_pre_hook(pre_hook, with_kwargs=True),
                   self.model.register_forward_hook(post_hook, with_kwargs=True)]
        if assistant_model is not None:
            handles += [assistant_model.register_forward_pre_hook(draft_pre_hook, with_kwargs=True),
                        assistant_model.register_forward_hook(draft_post_hook, with_kwargs=True)]
        try:
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      generation_config=config, streamer=streamer, assistant_model=assistant_model)
        finally:
            for h in handles:
                h.remove()
        self.sync()
        total = time.perf_counter() - start
        tokens = truncate_at_stop(out[0, ids.shape[1]:].tolist(), stop_ids, max_new_tokens)
        _fit_committed(steps, len(tokens))
        committed = 0
        for s in steps:
            # Tokens fed = committed tokens not yet in the cache + candidates to verify.
            uncached = len(prompt_ids) + committed - s.context_tokens
            s.draft_tokens = max(0, s.forward_tokens - uncached)
            s.accepted_draft_tokens = max(0, min(s.committed - 1, s.draft_tokens))
            committed += s.committed
        # Whatever generate() did outside the forwards is overhead; spread it per step.
        outside = max(0.0, total - sum(s.target_time + s.draft_time for s in steps))
        for s in steps:
            s.overhead_time = outside / len(steps)
        ttft = streamer.first_token_time - start if streamer.first_token_time else total
        return Generation(tokens=tokens, steps=steps, ttft=ttft, stop_reason=stop_reason(tokens, stop_ids))

    @torch.inference_mode()
    def hf_generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids) -> list[list[int]]:
        """model.generate() on B prompts at once, greedy, left-padded (what transformers users batch
        with); each row's new tokens, cut at its first stop token. The peer of batched autoregressive."""
        width = max(map(len, prompts))
        pad = min(stop_ids) if stop_ids else 0
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                                 device=self.device)
        out = self.model.generate(input_ids=ids, attention_mask=attention,
                                  generation_config=self._generation_config(max_new_tokens, Sampling(), stop_ids))
        return [truncate_at_stop(row[width:].tolist(), stop_ids, max_new_tokens) for row in out]

    def _generation_config(self, max_new_tokens, sampling: Sampling, stop_ids, **extra) -> GenerationConfig:
        # Every knob that changes the output is set explicitly: generate() fills unset (None)
        # fields from the checkpoint's generation_config (e.g. llama-2-chat's sampling defaults).
        neutral = dict(
            max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=not sampling.greedy,
            repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1,
            eos_token_id=sorted(stop_ids), pad_token_id=min(stop_ids) if stop_ids else 0, use_cache=True,
        )
        if not sampling.greedy:
            neutral.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                           min_p=None, typical_p=1.0)
        neutral.update(extra)
        return GenerationConfig(**neutral)


class _StepStreamer(BaseStreamer):
    """generate() calls put() once with the prompt, then once per step with its new tokens."""

    def __init__(self, steps: list[Step]):
        self.steps = steps
        self.seen_prompt = False
        self.first_token_time: float | None = None

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.steps[-1].committed += int(value.numel())

    def end(self):
        pass


def _fit_committed(steps: list[Step], n_tokens: int) -> None:
    """After truncation at EOS/max_new_tokens, cap each step's count so they sum to n_tokens."""
    total = 0
    for s in steps:
        s.committed = min(s.committed, n_tokens - total)
        total += s.committed
