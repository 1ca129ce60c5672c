"""What every training script does with its frozen target the same way: where and in which dtype
it runs (--device, --dtype), the precision of the forward passes, the optimizer step, and how a
request is rendered into ids.

Placement: batches go to the target's input device (lm.device); the add-on is built by its loader
on lm.output_device (decoders/core/lm.py). Precision: the add-on keeps float32 master weights,
and every forward that mixes it with the frozen target (whose head, norm and readout stay in the
target's dtype) runs under autocast for the target's device type, in the target's dtype when that
is half precision (float16 then with a gradient scaler), so no matmul sees two dtypes.
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench.datasets import Prompt
from bench.prompts import render, rendering_for


def add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="auto, cpu, cuda or cuda:N (the run config's device=; default: its value, auto)")
    parser.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16 (the run config's dtype=)")


def target_overrides(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The Hydra overrides, with --device / --dtype as the run config's device= / dtype=."""
    extra = [f"{key}={value}" for key, value in (("device", args.device), ("dtype", args.dtype)) if value is not None]
    return [*overrides, *extra]


def load_target(model_cfg):
    """The target LM from the run config's model group; a usage error (a device this machine lacks, a
    model that does not fit) is one line on stderr and exit code 2, as `python -m bench` does. Eager:
    training reads features through hooks and backpropagates through add-ons, which a compiled
    decode step would not serve (and compiling costs minutes)."""
    from hydra.utils import instantiate

    from bench.errors import BenchError

    try:
        return instantiate(model_cfg, compile="none").load()
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def precision(lm, bf16: bool = False):
    """Autocast for a forward through the frozen target and the add-on: in the target's dtype when it
    is half precision; bfloat16 for a float32 target when `bf16` (faster on CPUs with AVX-512 BF16);
    else off (all float32)."""
    half = lm.dtype != torch.float32
    return torch.autocast(device_type=lm.device.type, dtype=lm.dtype if half else torch.bfloat16, enabled=half or bf16)


def grad_scaler(lm) -> torch.amp.GradScaler:
    """Loss scaling for a float16 target (its gradients would underflow); a pass-through otherwise."""
    return torch.amp.GradScaler(lm.device.type, enabled=lm.dtype == torch.float16)


def optimizer_step(scaler: torch.amp.GradScaler, optimizer, loss: torch.Tensor, clip: float | None = None) -> None:
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    if clip is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], clip)
    scaler.step(optimizer)
    scaler.update()


def request_ids(tokenizer, text: str) -> list[int]:
    """A user request as a benchmark run renders it (bench/prompts.py): the chat template when the
    tokenizer has one, else the raw text (a base model)."""
    prompt = Prompt(id="", turns=[text], raw_turns=[text])
    return render(tokenizer, prompt, 0, [], rendering_for(tokenizer, "auto"))[1]
