"""Hardware-aware W/N/G for lookahead decoding.

predicted speedup over autoregressive = compression / step cost, where compression (tokens
per decode step) is measured by running each grid point greedily on a few calibration
prompts, and step cost = latency of a forward of that point's mean forward tokens relative
to one autoregressive step, from this device's measured latency profile (decoders/tuning/profile.py).
Both measurements are cached, so a setting is chosen once per device, model and prompts.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from ..core.lm import LM
from .profile import _save_json, forward_latency, step_cost
from ..core.sampling import Sampling
from ..core.trace import Generation

AUTO = "auto"


# run(prompt_ids, max_new_tokens, sampling, window, ngram, guess_set_size) -> Generation
Run = Callable[[list[int], int, Sampling, int, int, int], Generation]


def tune(lm: LM, prompts: list[list[int]], stop_ids, *, window, ngram, guess_set_size, windows, ngrams,
         tokens: int, run: Run, cache_dir=None, profile_tokens: int = 64, sampling: Sampling | None = None,
         settings_key: dict | None = None) -> dict:
    """The grid point maximising predicted tokens/s, with the whole table. Parameters given
    as "auto" range over `windows` / `ngrams`; guess_set_size "auto" follows W (the paper's G = W).
    Compression is measured by `run` (lookahead with the other settings fixed, which
    `settings_key` names for the cache) at `sampling`, the run's own settings (default greedy)."""
    sampling = sampling or Sampling()
    decode_kwargs = settings_key or {}

    profile = forward_latency(lm, cache_dir, max_tokens=profile_tokens)
    grid = [(w, n, w if guess_set_size == AUTO else guess_set_size)
            for w in (windows if window == AUTO else [window])
            for n in (ngrams if ngram == AUTO else [ngram])]
    settings = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "seed": None if sampling.greedy else sampling.seed}
    key = json.dumps([profile["key"], prompts, grid, tokens, sorted(stop_ids), decode_kwargs]
                     + ([settings] if not sampling.greedy else []), sort_keys=True)  # greedy keys stay as before
    path = None
    if cache_dir:
        path = Path(cache_dir).expanduser() / "tuning" / f"lookahead-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"
        if path.exists():
            table = json.loads(path.read_text())
            return _choose(table, profile)
    table = []
    for w, n, g in grid:
        committed = steps = forward_tokens = 0
        for ids in prompts:
            gen = run(ids, tokens, sampling, w, n, g)
            decode = gen.steps[1:]  # the prefill step costs the same for every method
            committed += sum(s.committed for s in decode)
            steps += len(decode)
            forward_tokens += sum(s.forward_tokens for s in decode)
        table.append({"window": w, "ngram": n, "guess_set_size": g,
                      "compression": committed / steps if steps else 1.0,
                      "forward_tokens": forward_tokens / steps if steps else 1.0})
    if path is not None:
        _save_json(path, table)  # atomic: a concurrent run (sweep job, test worker) reads it whole or not at all
    return _choose(table, profile)


def _choose(table: list[dict], profile: dict) -> dict:
    for row in table:
        row["step_cost"] = step_cost(profile, row["forward_tokens"])
        row["predicted_speedup"] = row["compression"] / row["step_cost"]
    best = max(table, key=lambda r: r["predicted_speedup"])
    return {"window": best["window"], "ngram": best["ngram"], "guess_set_size": best["guess_set_size"],
            "predicted_speedup": best["predicted_speedup"],
            "predicted_tokens_per_s": best["predicted_speedup"] / profile["autoregressive_s"],
            "latency_profile": profile["key"], "table": table}
