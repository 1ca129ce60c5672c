"""The thin wrapper every decoder talks to instead of transformers: load, forward, forward_batch.

transformers' model API details (4D-mask formats per attention implementation, hidden states and
features by hook) live here; its caches in kv_cache, generate() in hf_trace, kernels in fast_path.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from . import attention, host_memory, kernels
from .compiled import COMPILE_MODES, CompiledForward, compile_supported
from .fast_path import (FAST_PATHS, PACKED_MIN_ROWS, PrepackedLinear, linear_problem, prepack, prepacked_supported,
                        unpack)
from .kv_cache import BatchKVCache, KVCache, cache_kwarg, causal_mask, full_history_cache
from .layer_types import AttentionPattern
from .sampling import PanelMaxima
from .transfer import to_device


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), as a soft-capping model's own forward applies it after its head (the same
    operations in the same order); logits unchanged where cap is None."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def forward_flops(spec: dict, tokens: float, context: float) -> float:
    """FLOPs of one forward of `tokens` new tokens after `context` cached ones (spec: LM.flops_spec()): the
    dense matmuls, and attention over the (query, key) pairs each layer computes, a sliding layer's up to
    its window (spec["sliding"]: [window, layers] pairs; absent, every layer attends to the whole context)."""
    dense = 2.0 * spec["matmul_params"] * tokens
    sliding = spec.get("sliding") or []
    full = spec["n_layers"] - sum(layers for _, layers in sliding)
    pairs = full * attended_pairs(tokens, context) + sum(
        layers * attended_pairs(tokens, context, window) for window, layers in sliding)
    return dense + 4.0 * spec["d_attn"] * pairs


def attended_pairs(tokens: float, context: float, window: float | None = None) -> float:
    """(query, key) pairs of `tokens` new tokens fed causally after `context`: new token i sees
    context + i + 1 keys, or `window` once that many are behind it."""
    every = tokens * context + tokens * (tokens + 1) / 2
    if window is None or context + tokens <= window:
        return every
    under = max(0.0, min(tokens, window - context))  # the first tokens, which see fewer than `window`
    return under * context + under * (under + 1) / 2 + (tokens - under) * window


@dataclass(frozen=True)
class DraftCost:
    """A draft forward's FLOPs: forward_flops over the draft's own layers plus the rows read out, from
    terms read off its shapes once (reading the head through transformers' get_output_embeddings at
    every draft call cost 0.1 ms a step: results/reference/eagle_authors_overhead/)."""

    spec: dict  # forward_flops' spec: matmul_params, n_layers (1: d_attn is summed over layers), d_attn
    readout: int  # the head's weights, per row read out

    @classmethod
    def of(cls, dense: int, attention: int, readout: int) -> "DraftCost":
        return cls({"matmul_params": dense, "n_layers": 1, "d_attn": attention}, readout)

    def __call__(self, rows: int, context: int, logit_rows: int) -> float:
        """One forward of `rows` rows after `context` cached ones, `logit_rows` of them read out."""
        return forward_flops(self.spec, rows, context) + 2.0 * self.readout * logit_rows


def use_attention_kernels() -> None:
    """On a GPU, scaled_dot_product_attention runs the memory-efficient kernel (math where that one
    cannot). cuDNN's, torch's first choice on an H100, plans for each new shape, and a decode's
    context is a new length at every step: 57-70 ms a step against 18-21 (Vicuna-7B's shape, fp16).
    Flash cannot take a tree's mask, so with it a one-token step and a k-token verification attend
    by different kernels: their logits were up to 9.8 ulps apart, 7.0 with the one kernel, at the
    same speed (results/reference/gpu/2026-11-26-h100-attention/)."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(True)


def timing_events(device: torch.device):
    """A factory of CUDA timing events, each recorded on `device`'s current stream as it is made."""
    def record() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return record


class LM:
    """A HF causal LM, its tokenizer, and what metrics need to know about it."""

    def __init__(self, model, tokenizer=None, name: str = "model", max_context: int | None = None,
                 fast_path: str = "none", compile: str = "none"):
        # Never trained through this wrapper: frozen once, so that a draft sharing a weight (a tied head
        # read by EAGLE's draft) cannot flip a flag a compiled forward guards on.
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        # The one placement rule (add-ons and per-step tensors follow it): inputs go to `device`, the
        # embedding's; logits, hidden states and features come out on `output_device`, the head's
        # (the same device unless model.device_map spread the layers). `dtype` is the weights' dtype.
        self.device = model.get_input_embeddings().weight.device
        self.head = model.get_output_embeddings()  # the readout (the same module whatever path its class takes)
        self.output_device = self.head.weight.device
        self.dtype = model.dtype
        self.cuda_devices = sorted({p.device for p in model.parameters() if p.device.type == "cuda"},
                                   key=lambda d: d.index or 0)
        self.attn_implementation = model.config._attn_implementation
        # Which keys each layer sees (full context, or a sliding window): every mask the harness builds
        # is narrowed per layer type by it (refused here where a layer attends another way).
        self.pattern = AttentionPattern.of(self.config)
        # A step's big tensors (logits rows: a megabyte each at 262k tokens) reused, not handed back to the OS
        self.host_allocator = host_memory.keep_freed_blocks()
        if self.attn_implementation == "sdpa":
            attention.install()  # grouped-query attention on a CPU without copying the cache
        if self.cuda_devices:
            use_attention_kernels()
        # A decode's timer (trace.new_tracer): events on the one GPU's stream, read when the decode ends, so
        # timing waits for nothing; None (the host's clock, synchronised) on a CPU or across several GPUs,
        # whose work one stream's events would not bracket. scripts/step_overhead.py sets None: it times
        # the host's own regions.
        self.timing_event = timing_events(self.cuda_devices[0]) if len(self.cuda_devices) == 1 else None
        self.cache_kw = cache_kwarg(model)
        self.max_context = max_context or getattr(self.config, "max_position_embeddings", None)
        self.stop_ids = self._stop_ids()
        self._hidden: torch.Tensor | None = None
        self._want_hidden = False
        self._features: torch.Tensor | None = None
        self._flops_spec: dict | None = None
        # The last forward's logits as it returned them, and their panel maxima, where the readout is on the
        # kernel path (else None): an argmax over 262,144 logits reads those instead of the row (maxima_of)
        self._maxima: tuple[torch.Tensor, PanelMaxima] | None = None
        model.base_model.register_forward_hook(self._capture_hidden)
        # A model whose modules are shared with an LM already on the fast path (a self-draft) is on it too.
        packed = [m for m in model.modules() if type(m) is PrepackedLinear]
        self.fast_path = "prepacked" if packed else "none"
        if any(type(m) is kernels.KernelLinear for m in model.modules()):
            self.fast_path = "kernel"
            kernels.keep_panel_maxima(self.head)
        self.packed_min_rows = packed[0]._min_rows if packed else None  # rows from which "prepacked" packs
        self.fast_path_note = ""  # why the path in use differs from the one asked for, if it does
        self.fast_path_bytes = 0  # memory the fast path holds beyond the model's own weights
        if fast_path != self.fast_path or fast_path != "none":  # packs what is not packed yet
            self.set_fast_path(fast_path, self.packed_min_rows)
        self.compiled: CompiledForward | None = None
        self.compile, self.compile_note = "none", ""
        self.set_compile(compile)

    def set_compile(self, mode: str) -> str:
        """model.compile: "none" (eager) or "inductor" (the decode-step forward compiled, compiled here
        and now so that no timed run pays for it: compile_seconds). A model it cannot run stays eager,
        with the reason in compile_note. Set it after the fast path: the graph is traced over it."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
        if self.compiled is not None:
            self.compiled.remove()
            self.compiled = None
        self.compile, self.compile_note = "none", ""
        if mode == "inductor":
            why_not = compile_supported(self.model) or (
                "the model is spread over several devices" if len(self.cuda_devices) > 1 else None)
            if why_not:
                self.compile_note = f"inductor unavailable: {why_not}"
            else:
                self.compiled = CompiledForward(self.model, self.cache_kw)
                self.compiled.warm(self.device, self.vocab_size, lambda: full_history_cache(self.config),
                                   self._causal_attention)
                self.compile = "inductor"
        return self.compile

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling (tracing included), at load and in any later re-trace."""
        return self.compiled.compile_seconds if self.compiled is not None else 0.0

    # ---- fast forward path ------------------------------------------------------------------
    def set_fast_path(self, path: str, min_rows: int | None = None) -> str:
        """Switch the kernel path of every linear layer: "none" (transformers' own),
        "prepacked" (oneDNN-packed weights for inputs of `min_rows` rows or more, CPU; default
        PACKED_MIN_ROWS for the dtype) or "kernel" (ours, decoders/core/kernels.py: inputs of 1 to
        kernels.MAX_ROWS rows, CPU with AVX-512 or AVX2; built at first use, kernel_build_seconds). A path
        this machine cannot run falls back to "none", with the reason in fast_path_note. Returns the
        path in use."""
        if path not in FAST_PATHS:
            raise ValueError(f"fast path {path!r} is not one of {', '.join(FAST_PATHS)}")
        if min_rows is not None and (not isinstance(min_rows, int) or min_rows < 1):
            raise ValueError(f"packed min_rows must be an integer >= 1, not {min_rows!r}")
        self.fast_path_note = ""
        if path != self.fast_path:  # off the path in use first: one path at a time
            unpack(self.model)
            kernels.unswap(self.model)
            self.fast_path, self.fast_path_bytes, self.packed_min_rows = "none", 0, None
        if path == "none":
            unpack(self.model)
            kernels.unswap(self.model)
            self.fast_path, self.fast_path_bytes, self.packed_min_rows = "none", 0, None
        elif path == "kernel":
            why_not = kernels.kernel_supported(self.model)
            if why_not:
                self.fast_path_note = f"kernel unavailable: {why_not}"
            else:
                self.fast_path_bytes += kernels.swap(self.model)
                self.fast_path = "kernel"
                kernels.keep_panel_maxima(self.head)
        else:
            why_not = prepacked_supported(self.model)
            if why_not:
                self.fast_path_note = f"prepacked unavailable: {why_not}"
            else:
                self.packed_min_rows = min_rows or PACKED_MIN_ROWS.get(self.dtype, 1)
                self.fast_path_bytes += prepack(self.model, self.packed_min_rows)
                self.fast_path = "prepacked"
        return self.fast_path

    def accelerate(self, module: nn.Module) -> nn.Module:
        """Put an add-on that runs beside the model (Medusa heads, a feature draft) on the same path; one
        in another dtype (a bfloat16 draft beside a float32 target) packs from that dtype's default rows."""
        if self.fast_path == "prepacked":
            dtype = next(module.parameters(), self.model.get_input_embeddings().weight).dtype
            if dtype != self.dtype and linear_problem(dtype) is not None:  # a dtype oneDNN cannot run here stays native
                return module
            rows = self.packed_min_rows if dtype == self.dtype else PACKED_MIN_ROWS.get(dtype, 1)
            self.fast_path_bytes += prepack(module, rows)
        elif self.fast_path == "kernel":  # a dtype the kernel cannot run here stays native
            self.fast_path_bytes += kernels.swap(module)
        return module

    @property
    def kernel_build_seconds(self) -> float:
        """Seconds this process spent building the kernel path's extension (0: loaded from torch's cache)."""
        return kernels.build_seconds

    @property
    def logit_cap(self) -> float | None:
        """The target's final logit soft-cap (Gemma 2's final_logit_softcapping), or None."""
        return getattr(self.config.get_text_config(), "final_logit_softcapping", None) or None

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """soft_cap with the target's cap: for a draft that reads the target's head."""
        return soft_cap(logits, self.logit_cap)

    # ---- what metrics need -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def flops_spec(self) -> dict:
        """Parameters doing matmul work per token (all but the input-embedding lookup; a tied output head
        is a matmul and counts; of a mixture of experts, the top-k a token is routed to), layers,
        attention width, and the sliding layers with their windows (forward_flops reads it; flops_counted
        says it in words). Computed once."""
        if self._flops_spec is None:
            unique = {p.data_ptr(): p.numel() for p in self.model.parameters()}
            emb = self.model.get_input_embeddings().weight
            head = self.model.get_output_embeddings().weight
            matmul = sum(unique.values()) - emb.numel() + (head.numel() if head.data_ptr() == emb.data_ptr() else 0)
            cfg = self.config.get_text_config()
            experts, routed = self._experts()
            if experts:
                expert_params = sum(p.numel() for name, p in self.model.named_parameters() if ".experts." in name)
                matmul -= expert_params * (1 - routed / experts)
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            windows = [w for w in self.pattern.windows if w is not None]
            self._flops_spec = {"matmul_params": int(matmul), "n_layers": int(cfg.num_hidden_layers),
                                "d_attn": int(cfg.num_attention_heads * head_dim)}
            if windows:
                self._flops_spec["sliding"] = [[w, windows.count(w)] for w in sorted(set(windows))]
        return copy.deepcopy(self._flops_spec)

    def _experts(self) -> tuple[int, int]:
        """(experts a layer holds, experts a token is routed to); (0, 0) for a dense model."""
        cfg = self.config.get_text_config()
        experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
        routed = getattr(cfg, "num_experts_per_tok", None)
        return (int(experts), int(routed)) if experts and routed else (0, 0)

    def flops_counted(self) -> str:
        """How flops_spec counts this model's FLOPs, in words (provenance)."""
        experts, routed = self._experts()
        dense = "dense: every matmul parameter once a token" + (
            f" (of the experts, the {routed} of {experts} a token is routed to)" if experts else "")
        sliding = self.flops_spec().get("sliding")
        attention = "attention: every layer over the whole context" if not sliding else "attention: " + ", ".join(
            f"{n} sliding layers over their {w}-token window" for w, n in sliding) + ", the rest over the whole context"
        return f"{dense}; {attention}"

    def widened(self) -> nn.Module | None:
        """A copy of the model in the next wider dtype (float64 for float32, float32 for half
        precision) on transformers' own kernels, for the lossless check's referee: its rounding is
        far below the run's, so it ranks near-ties as the model itself does. Made per use, never
        kept (a 7B float32 copy is 28 GB); None where it does not fit in memory."""
        wide = torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else torch.float64
        # The memo keeps out of the copy this LM (hooks on the model are its bound methods) and the
        # fast paths' packed weights (opaque tensors, not copyable; unpack drops them).
        memo = {id(self): self}
        for module in self.model.modules():
            for attr in ("_packed", "_kernel_packed"):
                if attr in module.__dict__:
                    memo[id(module.__dict__[attr])] = None
        try:
            model = copy.deepcopy(self.model, memo=memo)
            unpack(model)
            kernels.unswap(model)
            return model.to(wide)
        except torch.OutOfMemoryError:
            if self.cuda_devices:
                torch.cuda.empty_cache()
            return None

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
    def new_cache(self, reserve: int = 0) -> KVCache:
        """An empty cache, room for `reserve` positions made at its first forward. One slab for all
        layers (kv_cache.KVSlab) unless the forward is compiled (its graph keeps DynamicCache's
        layout) or the layers are spread over devices."""
        compiled = self.compiled is not None
        return KVCache.for_model(self.config, reserve, slab=len(self.cuda_devices) <= 1, contiguous=compiled,
                                 positions=self.pattern.sliding)

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
        return self._attention_form(to_device(mask, self.device)[None, None])

    def _attention_form(self, mask: torch.Tensor) -> torch.Tensor:
        """A bool (B, 1, q, k) mask on the model's device as its attention takes it: bool for sdpa,
        additive for eager."""
        if self.attn_implementation == "sdpa":
            return mask
        if self.attn_implementation == "eager":
            return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.dtype).min)
        raise ValueError("custom attention masks need attn_implementation 'sdpa' or 'eager', "
                         f"not {self.attn_implementation!r}")

    def attention_mask(self, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
                       ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The forward's attention_mask for bool `allowed` (B, q, k) or (q, k): narrowed per layer type by the
        token positions of queries and keys (layer_types.AttentionPattern.masks), each in the form the
        model's attention takes, (B, 1, q, k). A model of one layer type takes one mask, else a dict by type."""
        if allowed.dim() == 2:
            allowed, query_positions, key_positions = allowed[None], query_positions[None], key_positions[None]
        if not self.pattern.sliding:
            return self._attention_form(to_device(allowed, self.device)[:, None])
        if self.device.type == "cpu":  # in numpy: between forwards each torch operation costs several numpy ones
            masks = self.pattern.masks(allowed.numpy(), query_positions.numpy(), key_positions.numpy())
            masks = ({kind: torch.from_numpy(m) for kind, m in masks.items()} if isinstance(masks, dict)
                     else torch.from_numpy(masks))
        else:
            masks = self.pattern.masks(to_device(allowed, self.device), to_device(query_positions, self.device),
                                       to_device(key_positions, self.device))
        if isinstance(masks, dict):
            return {kind: self._attention_form(m[:, None]) for kind, m in masks.items()}
        return self._attention_form(masks[:, None])

    def _causal_attention(self, q: int, cached: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """attention_mask for `q` new tokens fed causally after `cached` ones at positions 0, 1, ..."""
        positions = torch.arange(cached + q)
        return self.attention_mask(causal_mask(q, cached), positions[cached:], positions)

    @torch.inference_mode()
    def forward(self, input_ids, cache: KVCache, position_ids=None, mask: torch.Tensor | None = None, *,
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
        ids = to_device(input_ids, self.device, torch.long).reshape(1, -1)
        q, cached = ids.shape[1], len(cache)
        kwargs = {}
        if position_ids is not None:
            kwargs["position_ids"] = to_device(position_ids, self.device, torch.long).reshape(1, -1)
        if mask is not None:
            if mask.shape != (q, cached + q):
                raise ValueError(f"mask shape {tuple(mask.shape)} != (new, cache + new) = {(q, cached + q)}")
            if position_ids is None:
                raise ValueError("a custom mask needs explicit position_ids")
        if cache.positions is not None:
            # Sliding-window layers: the mask is ours whatever was fed, built from the positions the
            # cache's slots hold (a draft's cache may hold a tree's nodes, not 0, 1, ...).
            fed = (kwargs["position_ids"][0] if position_ids is not None
                   else torch.arange(cached, cached + q, device=self.device))  # transformers' default
            cache.fed(fed)
            kwargs["attention_mask"] = self.attention_mask(mask if mask is not None else causal_mask(q, cached),
                                                           fed, cache.positions)
            kwargs["position_ids"] = fed.reshape(1, -1)
        elif mask is not None:
            kwargs["attention_mask"] = self.mask_4d(mask)
        if last_only:
            logits_last = 1
        if self.compiled is not None:
            attention = kwargs.get("attention_mask")
            if attention is None:
                attention = self._attention_form(to_device(causal_mask(q, cached), self.device)[None, None])
            return self._forward_compiled(ids, cache, kwargs.get("position_ids"), attention, logits_last=logits_last,
                                          logits_rows=logits_rows, hidden=hidden, features=features)
        if logits_last is not None:
            kwargs["logits_to_keep"] = int(logits_last)
        if logits_rows is not None:
            # it indexes the last hidden state, which is on the head's side
            kwargs["logits_to_keep"] = to_device(logits_rows, self.output_device, torch.long)
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
        self._keep_maxima(out.logits, logits)
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

    def _keep_maxima(self, readout: torch.Tensor, logits: torch.Tensor) -> None:
        """Note the panel maxima of `logits` (q, V), which the forward returns, where the readout kept them:
        `readout` is the readout's own output ((1, q, V) or (q, V)) as the model passed it on."""
        kept = kernels.panel_maxima_of(self.head, readout) if self.fast_path == "kernel" else None
        if kept is None:
            self._maxima = None
            return
        values, where, panel = kept
        if values.dim() == 3:
            values, where = values[0], where[0]
        self._maxima = logits, PanelMaxima(values, where, panel)

    def maxima_of(self, logits: torch.Tensor) -> PanelMaxima | None:
        """The panel maxima of `logits` if they are the last forward's logits, the very tensor it returned
        (sampling.PanelMaxima: an argmax reads those instead of the row); None otherwise: other logits, or
        a readout off the kernel path. Logits changed in place would keep stale maxima: nothing does that."""
        kept = self._maxima
        return kept[1] if kept is not None and kept[0] is logits else None

    def _forward_compiled(self, ids, cache: KVCache, positions, attention, *, logits_last, logits_rows, hidden,
                          features):
        """LM.forward through the compiled base model: the same outputs, the head applied here to the rows wanted.
        attention: the forward's attention_mask, as the model takes it."""
        q, cached = ids.shape[1], len(cache)
        if positions is None:
            positions = torch.arange(cached, cached + q, device=self.device).reshape(1, -1)
        h, final, layers = self.compiled(ids, positions, attention, cache.hf, cached)
        h = h[0].to(self.output_device)
        if logits_rows is not None:
            h = h[to_device(logits_rows, self.output_device, torch.long)]
        elif logits_last is not None:
            h = h[-int(logits_last):]
        logits = self.head(h)
        self._keep_maxima(logits, logits)
        if features is True:
            return logits, final[0].to(self.output_device)
        if features:
            return logits, torch.cat([layers[i][0] for i in features], -1).to(self.output_device)
        return (logits, h) if hidden else logits

    def new_batch_cache(self, rows: int) -> BatchKVCache:
        return BatchKVCache(full_history_cache(self.config), rows)

    @torch.inference_mode()
    def forward_batch(self, feeds: Sequence[Sequence[int]], cache: BatchKVCache, positions: Sequence[torch.Tensor],
                      masks: Sequence[torch.Tensor | None], rows: Sequence[Sequence[int]], *, hidden: bool = False,
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
        mask = torch.cat([cache.valid[:, None, :] & real[:, :, None], new], dim=2)  # (b, width, slots + width)
        columns = sorted({o + i for o, want in zip(offsets, rows) for i in want})
        at = {col: j for j, col in enumerate(columns)}
        if columns == list(range(width - len(columns), width)):
            keep = len(columns)  # a suffix: transformers slices, no gather
        else:
            keep = to_device(columns, self.output_device, torch.long)
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ValueError("batched decoding needs attn_implementation 'sdpa' or 'eager', "
                             f"not {self.attn_implementation!r}")
        # A padding token's position is never compared: it sees only itself.
        keys = torch.cat([cache.positions(), pos], 1) if self.pattern.sliding else pos  # read by sliding layers only
        attention = self.attention_mask(mask, pos, keys)
        self._want_hidden = hidden
        handles = self._hook_features(features)
        try:
            out = self.model(input_ids=to_device(ids, self.device), position_ids=to_device(pos, self.device),
                             attention_mask=attention,
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


@dataclass
class TargetParts:
    """What a draft borrows from its target. Held in a plain object, not as submodules, so that the
    draft's state dict, training, .to() and dtype casts leave them alone."""

    lm: LM
    embedding: nn.Module | None = None  # the target's input embedding, for a draft file without its own
    readout: nn.Module | None = None  # ours: the head's rows over the draft vocabulary
    rotary: nn.Module | None = None  # ours: the rotary table, float32 whatever the draft's dtype
