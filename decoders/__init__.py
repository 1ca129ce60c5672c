"""Decoding methods and what they share.

    core/     primitives: the LM wrapper, its KV caches, kernel path and generate() tracing (the only
              code that knows transformers), token trees, verification, sampling, the per-step trace,
              and the one propose -> verify -> commit loop
    methods/  one module per method, each a small proposer over core/ (plus the add-ons they load)
    tuning/   latency profiles, the fast-path choice, lookahead's W/N/G search, Sequoia's tree DP
"""
from .core.kv_cache import KVCache
from .core.lm import LM
from .core.sampling import Sampling
from .core.trace import Generation, Step
from .core.tree import TokenTree

__all__ = ["LM", "KVCache", "Sampling", "Generation", "Step", "TokenTree"]
