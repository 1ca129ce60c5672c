"""The checks of a composed config that need nothing but the config: no model, data, decoder or
torch. `python -m bench` runs them on every job of a run or sweep, and `python -m bench.leaderboard`
on every entry, before anything imports torch (seconds), so that a bad value is one line at once;
runner.check_config runs them again beside the checks that build the decoder and the model spec.
"""
from __future__ import annotations

import math

from .datasets import check_limit
from .errors import BenchError
from .prompts import FORMATS

BOOLEANS = ("check_lossless", "quality", "warmup", "resume", "progress")  # conf/config.yaml's switches


def check_settings(cfg) -> None:
    """One line naming the first bad value among the run's own settings (not the decoder's, the
    model's or the dataset's, which their classes check when built)."""
    for key in BOOLEANS:  # Hydra hands quality=no or resume=maybe over as strings, which Python reads as true
        if key in cfg and not isinstance(cfg[key], bool):
            raise BenchError(f"{key} must be true or false, got {cfg[key]!r}")
    check_gen_settings(cfg)
    check_seed(cfg.seed)
    size = cfg.gen.get("batch_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise BenchError(f"gen.batch_size must be an integer >= 1, got {size!r}")
    if cfg.threads is not None and not (isinstance(cfg.threads, int) and cfg.threads >= 1):
        raise BenchError(f"threads must be a positive integer or null (torch's default), got {cfg.threads!r}")
    check_limit(cfg.dataset.get("limit"))
    if not isinstance(cfg.get("prompt_format", "auto"), str) or cfg.get("prompt_format", "auto") not in FORMATS:
        raise BenchError(f"prompt_format={cfg.prompt_format!r} is not one of {', '.join(FORMATS)}")


def check_gen_settings(cfg) -> None:
    """gen.* of the right types, and check_lossless only with greedy decoding. The ranges of the
    sampling settings are Sampling's own (decoders/core/sampling.py), checked where it is built."""
    gen = cfg.gen
    if not (isinstance(gen.max_new_tokens, int) and gen.max_new_tokens >= 1):
        raise BenchError(f"gen.max_new_tokens must be an integer >= 1, got {gen.max_new_tokens!r}")
    for key in ("temperature", "top_p"):
        value = gen[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BenchError(f"gen.{key} must be a finite number, got {value!r}")
    if cfg.check_lossless and gen.temperature != 0:
        raise BenchError("check_lossless=true compares against autoregressive greedy output "
                         "and needs gen.temperature=0; sampling is checked by the statistical tests")


def check_seed(seed) -> None:
    """A seed torch's generators take: else one line now, not a traceback at the first sampled prompt."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BenchError(f"seed must be an integer, got {seed!r}")
    if not 0 <= seed < 2**64:
        raise BenchError(f"seed must be an integer from 0 to 2**64 - 1, got {seed}")
