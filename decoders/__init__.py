"""Decoding methods and what they share.

    core/     primitives: the LM wrapper, its KV caches, kernel path and generate() tracing (where
              transformers' model API is handled; methods/eagle_draft.py, eagle.py and published.py also
              use it for drafts' layers and caches), token trees, verification, sampling, the per-step trace,
              and the one propose -> verify -> commit loop
    methods/  one module per method, each a small proposer over core/ (plus the add-ons they load)
    tuning/   latency profiles, the fast-path choice, lookahead's W/N/G search, Sequoia's tree DP
"""
from pkgutil import extend_path

# A method kept outside this checkout: DIR/decoders/methods/<name>.py with DIR on PYTHONPATH joins
# decoders.methods (and so the classes a config may build, bench/targets.py); its YAML joins with
# hydra.searchpath=[file://DIR/conf] (bench/registry.py).
__path__ = extend_path(__path__, __name__)

from .core.kv_cache import KVCache  # noqa: E402
from .core.lm import LM  # noqa: E402
from .core.sampling import Sampling
from .core.trace import Generation, Step
from .core.tree import TokenTree

__all__ = ["LM", "KVCache", "Sampling", "Generation", "Step", "TokenTree"]
