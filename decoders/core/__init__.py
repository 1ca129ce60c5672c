"""Core primitives every method shares: the LM wrapper, token trees, verification, sampling, the trace,
and the one decoding loop."""
