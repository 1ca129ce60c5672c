"""llama.cpp as the target's engine: the LM wrapper decoders drive, over llama-cpp-python's low-level bindings.

forward() takes what LM.forward takes (ids, a cache, positions and a tree's bool mask, the rows whose
logits are wanted) and runs one llama_decode: the mask becomes sequence ids (llama_sequences), only the
rows asked for are output, and their logits come back as a float32 tensor. The cache's edits are
llama.cpp's memory API. The loop, verification and every method run unchanged.

One llama.cpp context holds one cache: new_cache() takes a context no live cache holds (cleared), or
makes one, so that a generation and the lossless check's own passes never share a memory.
"""
from __future__ import annotations

import ctypes
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .layer_types import AttentionPattern
from .llama_sequences import SequenceCache

# What the engine gives a decoder beside logits (contract.check_engine): none of the target's torch
# modules, and no hidden state or features (its embeddings output is not wired here).
GIVES = frozenset({"logits"})


GGML_LOG_LEVEL_ERROR = 4  # ggml.h's (llama-cpp-python's logger takes 3 for an error: it showed warnings, hid errors)


def bindings():
    """llama_cpp's low-level module, or one line saying how to install it. llama.cpp's log goes to stderr for its
    errors only."""
    try:
        import llama_cpp
    except ImportError:
        raise ImportError("model.backend=llamacpp needs llama-cpp-python: pip install llama-cpp-python==0.3.36 "
                          "(it compiles llama.cpp: docs/llamacpp.md)") from None
    global _log_errors
    if _log_errors is None:
        _log_errors = llama_cpp.llama_log_callback(_errors_only)
        llama_cpp.llama_log_set(_log_errors, ctypes.c_void_p(0))
    return llama_cpp


def _errors_only(level: int, text: bytes, user_data) -> None:
    if level == GGML_LOG_LEVEL_ERROR:
        print(text.decode(errors="replace"), end="", file=sys.stderr, flush=True)


_log_errors = None  # made once (ctypes keeps no reference of its own to a callback)


class _Memory:
    """llama_sequences.Memory over one context's llama_memory_t."""

    def __init__(self, lib, ctx):
        self.lib, self.mem = lib, lib.llama_get_memory(ctx)

    def rm(self, seq: int, p0: int, p1: int) -> None:
        if not self.lib.llama_memory_seq_rm(self.mem, seq, p0, p1):
            raise RuntimeError(f"llama.cpp could not remove positions {p0}..{p1} of sequence {seq}")

    def cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, False)


class _Batch:
    """A llama_batch whose arrays are numpy's, filled a forward at a time without a per-token Python loop."""

    def __init__(self, lib, capacity: int, n_seq: int):
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.zeros(capacity, np.int32)
        self.seq_id = np.zeros((capacity, n_seq), np.int32)
        self.logits = np.zeros(capacity, np.int8)
        rows = (ctypes.POINTER(ctypes.c_int32) * capacity)()
        base, stride = self.seq_id.ctypes.data, self.seq_id.strides[0]
        for i in range(capacity):
            rows[i] = ctypes.cast(base + i * stride, ctypes.POINTER(ctypes.c_int32))
        self._rows = rows
        self.batch = lib.llama_batch(
            n_tokens=0, token=self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), embd=None,
            pos=self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            n_seq_id=self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), seq_id=rows,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))
        self.capacity = capacity

    def fill(self, tokens: np.ndarray, positions: np.ndarray, seqs: list, outputs: np.ndarray) -> None:
        q = len(tokens)
        self.token[:q], self.pos[:q] = tokens, positions
        self.logits[:q] = 0
        self.logits[outputs] = 1
        if seqs[0] == (0,):  # a causal feed: sequence 0 alone (place() never gives a tree's tokens 0)
            self.n_seq_id[:q], self.seq_id[:q, 0] = 1, 0
        else:
            for i, s in enumerate(seqs):
                self.n_seq_id[i] = len(s)
                self.seq_id[i, :len(s)] = s
        self.batch.n_tokens = q


@dataclass
class _Context:
    ctx: object
    memory: _Memory
    batch: _Batch
    holder: object = field(default=None)  # weakref to the live cache using it


class LlamaCppCache(SequenceCache):
    """A SequenceCache bound to the context it lives in."""

    def __init__(self, context: _Context, n_seq: int):
        super().__init__(context.memory, n_seq)
        self.context = context


class LlamaCppLM:
    """A GGUF model on llama.cpp, with the harness's tokenizer, and what metrics need to know about it."""

    device = output_device = torch.device("cpu")
    dtype = torch.float32  # of the logits it returns
    cuda_devices: list = []
    timing_event = None
    attn_implementation = "llama.cpp"
    compile, compile_note, compile_seconds = "none", "", 0.0
    packed_min_rows, fast_path_note, fast_path_bytes, kernel_build_seconds = None, "", 0, 0.0
    gives = GIVES

    def __init__(self, gguf: Path, tokenizer, config, *, name: str, threads: int, n_ctx: int, n_seq: int = 64,
                 n_ubatch: int = 512, kv_type: str = "f16", max_context: int | None = None):
        lib = self.lib = bindings()
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        self.model_ptr = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model_ptr:
            raise ValueError(f"llama.cpp could not load {gguf}")
        self.gguf, self.tokenizer, self.config, self.name = Path(gguf), tokenizer, config, name
        self.pattern = AttentionPattern.of(config)
        self.threads, self.n_ctx, self.n_seq, self.n_ubatch, self.kv_type = threads, n_ctx, n_seq, n_ubatch, kv_type
        self.max_context = max_context
        self.vocab = lib.llama_model_get_vocab(self.model_ptr)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self.vocab))
        self.weights_type = _ftype(lib, self.model_ptr)
        self.fast_path = f"llamacpp-{self.weights_type.lower().replace(' ', '')}"
        self.stop_ids = frozenset(int(i) for i in ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                                                    else []))
        self._contexts: list[_Context] = []
        self._flops_spec: dict | None = None
        weakref.finalize(self, _free, lib, self._contexts, self.model_ptr)

    # ---- contexts and caches ------------------------------------------------------------
    def _new_context(self) -> _Context:
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = self.n_ctx
        params.n_ubatch = min(self.n_ubatch, self.n_ctx)
        params.n_seq_max = self.n_seq
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = True  # one buffer: sequences share the committed tokens' cells
        params.swa_full = True  # sliding layers keep the whole history: a rejected branch's rollback needs it
        params.type_k = params.type_v = KV_TYPES[self.kv_type]
        params.no_perf = True
        ctx = lib.llama_init_from_model(self.model_ptr, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {self.n_ctx} tokens for {self.name}")
        return _Context(ctx, _Memory(lib, ctx), _Batch(lib, self.n_ctx, self.n_seq))

    def new_cache(self, reserve: int = 0) -> LlamaCppCache:
        """An empty cache on a context no live cache holds (its memory cleared), or on a new one."""
        context = next((c for c in self._contexts if c.holder is None or c.holder() is None), None)
        if context is None:
            context = self._new_context()
            self._contexts.append(context)
        else:
            context.memory.clear()
        cache = LlamaCppCache(context, self.n_seq)
        context.holder = weakref.ref(cache)
        return cache

    def maxima_of(self, logits: torch.Tensor) -> None:
        """No panel maxima (LM.maxima_of): llama.cpp's readout keeps none; argmax reads the rows."""
        return None

    def sync(self) -> None:
        """llama_decode returns once its work is done on a CPU: nothing to wait for."""

    # ---- forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids, cache: LlamaCppCache, position_ids=None, mask: torch.Tensor | None = None, *,
                last_only: bool = False, hidden: bool = False, logits_last: int | None = None,
                logits_rows: Sequence[int] | None = None, features=False) -> torch.Tensor:
        """LM.forward's contract on llama.cpp: logits (rows, V) float32 of the rows asked for, in that order."""
        if hidden or features:
            raise ValueError(f"{self.name} runs on llama.cpp, which gives this harness logits only")
        if cache.context.holder is None or cache.context.holder() is not cache:
            raise ValueError("this cache's llama.cpp context was handed to a newer cache")
        tokens = np.asarray(input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids,
                            dtype=np.int32).reshape(-1)
        q = len(tokens)
        if mask is not None and position_ids is None:
            raise ValueError("a custom mask needs explicit position_ids")
        if len(cache) + q > self.n_ctx:
            raise ValueError(f"{len(cache)} cached + {q} new tokens exceed {self.name}'s llama.cpp context of "
                             f"{self.n_ctx}")
        positions = None if position_ids is None else np.asarray(
            position_ids.tolist() if isinstance(position_ids, torch.Tensor) else position_ids, np.int64)
        if positions is not None and mask is None:  # a causal feed at given positions: as the mask says it
            mask = np.tril(np.ones((q, len(cache) + q), bool), len(cache))
        mask_np = mask.numpy() if isinstance(mask, torch.Tensor) else mask
        pos, seqs = cache.place(positions, mask_np, q)
        if logits_rows is not None:
            rows = np.asarray(list(logits_rows), dtype=np.int64)
        elif last_only or logits_last is not None:
            rows = np.arange(q - (1 if last_only else int(logits_last)), q)
        else:
            rows = np.arange(q)
        outputs = np.unique(rows)
        context = cache.context
        context.batch.fill(tokens, pos, seqs, outputs)
        status = self.lib.llama_decode(context.ctx, context.batch.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status}) on {q} tokens after {len(cache)}")
        cache.added(pos, seqs)
        out = np.ctypeslib.as_array(self.lib.llama_get_logits(context.ctx), shape=(len(outputs), self.vocab_size))
        order = np.searchsorted(outputs, rows)
        return torch.from_numpy(out[order] if not np.array_equal(order, np.arange(len(outputs))) else out.copy())

    # ---- what metrics need -------------------------------------------------------------
    def flops_spec(self) -> dict:
        """As LM.flops_spec: parameters doing matmul work per token (the GGUF's tensors but the input
        embedding's lookup; a tied head counts as a matmul), layers, attention width, sliding windows."""
        if self._flops_spec is None:
            params = int(self.lib.llama_model_n_params(self.model_ptr))
            cfg = self.config.get_text_config()
            embedding = cfg.vocab_size * cfg.hidden_size
            tied = bool(getattr(cfg, "tie_word_embeddings", False))
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            self._flops_spec = {"matmul_params": params - (0 if tied else embedding),
                                "n_layers": int(cfg.num_hidden_layers),
                                "d_attn": int(cfg.num_attention_heads * head_dim)}
            windows = [w for w in self.pattern.windows if w is not None]
            if windows:
                self._flops_spec["sliding"] = [[w, windows.count(w)] for w in sorted(set(windows))]
        return dict(self._flops_spec)

    def flops_counted(self) -> str:
        sliding = self.flops_spec().get("sliding")
        attention = "attention: every layer over the whole context" if not sliding else "attention: " + ", ".join(
            f"{n} sliding layers over their {w}-token window" for w, n in sliding) + ", the rest over the whole context"
        return f"dense: every matmul parameter once a token (llama_model_n_params less the lookup); {attention}"

    def device_map(self) -> dict[str, int]:
        return {"cpu": 1}

    def engine(self) -> dict:
        """What provenance records of the engine."""
        return {"name": "llama.cpp", "bindings": "llama-cpp-python", "weights_type": self.weights_type,
                "kv_type": self.kv_type, "threads": self.threads, "n_ctx": self.n_ctx, "n_seq_max": self.n_seq,
                "n_ubatch": self.n_ubatch, "system_info": self.lib.llama_print_system_info().decode().strip()}

    def widened(self):
        """The lossless check's referee: second computations of the same logits by llama.cpp, each over the
        whole prefix in a context of its own with its batched kernels, not the one-token step's."""
        return _Prefill(self)


# The prefix's last tokens fed as one batch after the rest. llama.cpp rounds a row by its batch (repacked
# quantized kernels compute a batch's rows in tiles of 4 and the remainder one by one) and by the batches that
# filled the cache before it; a verification batch is neither the one-token step nor one forward over the
# prefix, so the check takes a second batching as well.
SPLIT = 4


class _Prefill:
    """referee_logits' model, called as a transformers model is. Its logits are (1, 1, computations, V):
    referee_logits reads [0, -1], every computation of the last position. One forward over the prefix, and
    (past SPLIT tokens) the prefix less its last SPLIT, then those SPLIT as one batch."""

    def __init__(self, lm: LlamaCppLM):
        self.lm = lm

    def __call__(self, input_ids, use_cache=False, logits_to_keep=1):
        ids = input_ids.reshape(-1).tolist()
        computations = [self.lm.forward(ids, self.lm.new_cache(), last_only=True)[-1]]
        if len(ids) > SPLIT:
            cache = self.lm.new_cache()
            self.lm.forward(ids[:-SPLIT], cache, last_only=True)
            computations.append(self.lm.forward(ids[-SPLIT:], cache, last_only=True)[-1])
        return _Output(torch.stack(computations)[None, None])


@dataclass
class _Output:
    logits: torch.Tensor


KV_TYPES = {"f32": 0, "f16": 1}


def _ftype(lib, model_ptr) -> str:
    """The model file's type as llama.cpp names it (e.g. "Q4_1", "all F32")."""
    name = lib.llama_ftype_name(lib.llama_model_ftype(model_ptr))
    return name.decode() if name else "unknown"


def _free(lib, contexts: list, model_ptr) -> None:
    for context in contexts:
        lib.llama_free(context.ctx)
    contexts.clear()
    lib.llama_model_free(model_ptr)
