"""Decoding methods: each a small proposer over decoders.core, plus the add-ons they load (drafts, heads, n-gram models)."""
