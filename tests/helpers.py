"""Shared builders for tests (imported as `from helpers import ...`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.models import GGUFPackageModel, TinyRandomModel
from decoders.lm import LM

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("BENCH_DATA_DIR") or REPO.parent / "shared" / "data")
CACHE_DIR = os.environ.get("BENCH_CACHE_DIR", "~/.cache/decoding-bench")


def tiny_lm(seed: int = 0, vocab: int = 64, layers: int = 2, attn: str = "sdpa", eos: int | None = None,
            init_std: float = 0.2, hidden: int = 64) -> LM:
    """A random Llama with a small vocabulary, no tokenizer."""
    spec = TinyRandomModel(num_layers=layers, hidden_size=hidden, seed=seed, init_std=init_std,
                           attn_implementation=attn, device="cpu", dtype="float32")
    return LM(spec.build(vocab, eos))


def smollm2() -> LM:
    return GGUFPackageModel(cache_dir=CACHE_DIR, device="cpu", dtype="float32").load()


def run_cli(*overrides: str, timeout: int = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m bench ...` in a subprocess, as a user runs it."""
    env = dict(os.environ, BENCH_DATA_DIR=str(DATA_DIR), BENCH_CACHE_DIR=CACHE_DIR, HYDRA_FULL_ERROR="0",
               WANDB_SILENT="true")
    return subprocess.run([sys.executable, "-m", "bench", *overrides], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env)
