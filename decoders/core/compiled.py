"""model.compile: the target's decode-step forward compiled by torch.compile (inductor).

Dynamic shapes: three graphs (one token; 2-3 tokens; 4-64, where dynamo's guards split the widths)
serve every feed width and cache length, traced while the model loads, over the same DynamicCache
the eager path uses, so crop and keep are unchanged. Prepacked linears stay packed inside the
graph (fast_path.packed_linear).
The vocabulary projection runs outside it on the rows asked for, and the features EAGLE reads
are taken by hooks that live as long as the model, so the graph never changes with what a call
asks for. Prefill (an empty cache) and feeds wider than MAX_WIDTH run the same body eagerly.
"""
from __future__ import annotations

import time

import torch
from torch import nn
from torch._dynamo.utils import counters

COMPILE_MODES = ("none", "inductor")
MAX_WIDTH = 64  # wider feeds (a prompt, lookahead's widest windows) run eagerly: the graph is for decode steps


def compile_supported(model: nn.Module) -> str | None:
    """None if model.compile=inductor can run this model, else why not."""
    if model.config._attn_implementation != "sdpa":
        return f"compiled forwards need attn_implementation sdpa, not {model.config._attn_implementation!r}"
    if getattr(model.config.get_text_config(), "final_logit_softcapping", None):
        return "the model soft-caps its logits; the compiled path applies the output head alone"
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    return None


class CompiledForward:
    """The base model's forward (ids, positions, bool mask, cache) -> (last hidden state, the final
    norm's input, every layer's input), compiled once for all shapes."""

    def __init__(self, model: nn.Module, cache_kw: str):
        self.base, self.cache_kw = model.base_model, cache_kw
        self.taps: dict = {}
        self.recording = False  # the hooks record only inside __call__: other forwards of these layers
        # (forward_batch, a self-draft, generate()) leave no taps behind for the graph to guard on
        self.hooks = [self.base.norm.register_forward_pre_hook(lambda m, args: self._tap("final", args[0]))]
        for i, layer in enumerate(self.base.layers):
            self.hooks.append(layer.register_forward_pre_hook(
                lambda m, args, kwargs, i=i: self._tap(i, args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True))
        # Dynamic from the first call: widths and cache lengths vary every step. Dynamo keeps the graphs
        # of every CompiledForward under one code object; past its default limit of 8 a process that
        # compiles a few models (tests, a self-draft's target) would silently fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.graph = torch.compile(self._body, dynamic=True)
        self.compile_seconds = 0.0  # every call that traced a graph, warm-up included
        self.graphs = 0  # calls that traced a graph

    def _tap(self, key, value):
        if self.recording:
            self.taps[key] = value

    def _body(self, ids, positions, mask, cache):
        out = self.base(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                        **{self.cache_kw: cache})
        layers = tuple(self.taps[i] for i in range(len(self.base.layers)))
        return out.last_hidden_state, self.taps["final"], layers

    def __call__(self, ids, positions, mask, cache, cached: int):
        """mask: the attention_mask the model takes, (1, 1, q, k) bool, or a dict of them by layer type."""
        compiled = cached > 0 and ids.shape[1] <= MAX_WIDTH
        # Dynamo guards on every input's dispatch keys: a mask made outside inference mode would re-trace
        # the graph inside a timed run, so each input is an inference tensor, as the cache's are.
        ids, positions = (t if t.is_inference() else t.clone() for t in (ids, positions))
        masks = {k: m if m.is_inference() else m.clone() for k, m in (mask.items() if isinstance(mask, dict)
                                                                     else [(None, mask)])}
        mask = masks if isinstance(mask, dict) else masks[None]
        if compiled:
            # Sizes that change every step are symbols from the start, so the graph is never re-traced:
            # the cache length, and the width beyond one token (a single token is its own graph).
            for layer in cache.layers:
                torch._dynamo.mark_dynamic(layer.keys, 2)
                torch._dynamo.mark_dynamic(layer.values, 2)
            for m in masks.values():
                torch._dynamo.mark_dynamic(m, 3)
            if ids.shape[1] > 1:
                for t in (ids, positions):
                    torch._dynamo.mark_dynamic(t, 1)
                for m in masks.values():
                    torch._dynamo.mark_dynamic(m, 2)
        graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
        self.recording = True
        try:
            return (self.graph if compiled else self._body)(ids, positions, mask, cache)
        finally:
            self.recording, self.taps = False, {}
            if counters["stats"]["unique_graphs"] != graphs:  # traced now: its time is compile time, said apart
                self.compile_seconds += time.perf_counter() - start
                self.graphs += 1

    def warm(self, device: torch.device, vocab: int, new_cache, causal) -> float:
        """Trace the graphs before anything is timed: one token, 2-3 tokens and 4 or more (dynamo's
        guards split the widths there); returns the compile seconds so far. causal(q, cached): the
        attention_mask of q tokens fed causally after `cached`, as the model takes it."""
        with torch.inference_mode():
            for width in (1, 2, 8):
                cache = new_cache()
                for q, cached in ((16, 0), (width, 16)):
                    ids = torch.arange(q, device=device).reshape(1, -1) % vocab
                    pos = torch.arange(cached, cached + q, device=device).reshape(1, -1)
                    self(ids, pos, causal(q, cached), cache, cached)
        return self.compile_seconds

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
