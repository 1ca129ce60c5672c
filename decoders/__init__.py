"""Decoding methods and the primitives they share (LM wrapper, token tree, verification)."""
from .lm import LM, KVCache
from .sampling import Sampling
from .trace import Generation, Step
from .tree import TokenTree

__all__ = ["LM", "KVCache", "Sampling", "Generation", "Step", "TokenTree"]
