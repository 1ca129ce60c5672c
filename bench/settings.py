"""The checks of a composed config that need nothing but the config: no model, data, decoder or
torch. `python -m bench` runs them on every job of a run or sweep, and `python -m bench.leaderboard`
on every entry, before anything imports torch (seconds), so that a bad value is one line at once;
runner.check_config runs them again beside the checks that build the decoder and the model spec.
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

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
    check_threads(cfg)
    if cfg.get("cache_dir") is not None:
        check_writable_dir("cache_dir", cfg.cache_dir, "set BENCH_CACHE_DIR (or cache_dir=) to a writable directory")
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


def check_threads(cfg) -> None:
    """threads: null or a positive integer up to this machine's cores (100000 threads ran out of
    memory after the model loaded). A sweep that SLURM runs is bounded by its nodes, inside the task."""
    threads, cores = cfg.threads, os.cpu_count() or 1
    if threads is None:
        return
    if not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
        raise BenchError(f"threads must be a positive integer or null (torch's default), got {threads!r}")
    slurm = "SlurmLauncher" in str(cfg.get("hydra", {}).get("launcher", {}).get("_target_", ""))
    if threads > cores and not slurm:
        raise BenchError(f"threads must be a positive integer or null (torch's default), at most this machine's "
                         f"{cores} cores, got {threads}")


def check_writable_dir(key: str, path, hint: str) -> None:
    """`path` is a directory this process may write in, or can be made one (its nearest existing
    parent takes files): else one line naming `key`, not a traceback where it is first used."""
    target = Path(str(path)).expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if os.path.exists(p))
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "a file stands in the path")
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise BenchError(f"{key}={path}: cannot write under {existing} ({e.strerror or e}); {hint}") from None
