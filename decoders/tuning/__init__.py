"""Tuning and profiling: latency profiles, the fast-path choice, lookahead's W/N/G search,
Sequoia's tree dynamic program."""
