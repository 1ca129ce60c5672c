"""Decoding methods: each a small proposer over decoders.core, plus the add-ons they load
(drafts, heads, n-gram models)."""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)  # DIR/decoders/methods/*.py on PYTHONPATH=DIR join (decoders/__init__.py)
