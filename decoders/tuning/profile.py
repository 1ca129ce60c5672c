"""This device's target-forward latency for 1..K new tokens: the cost side of hardware-aware
choices (lookahead's W/N/G, tree sizes). Measured once per device, threads, model and dtype,
then cached as JSON.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import re
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core import kernels
from ..core.compiled import COMPILE_MODES
from ..core.fast_path import FAST_PATHS
from ..core.kv_cache import KVCache
from ..core.lm import LM


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_key(lm: LM, fast_path: bool = True) -> str:
    """What the latency depends on: device (and CPU threads), model, dtype, attention kernel,
    and the linear layers' kernel path (left out for the key of the fast-path choice itself)."""
    threads = f"-{torch.get_num_threads()}threads" if lm.device.type == "cpu" else ""
    config = json.dumps(lm.config.to_dict(), sort_keys=True, default=str)
    model = hashlib.sha1(config.encode()).hexdigest()[:10]
    raw = (f"{device_name(lm.device)}{threads}_{lm.name}-{model}_"
           f"{str(lm.dtype).replace('torch.', '')}_{lm.attn_implementation}")
    if fast_path:
        raw += f"_{lm.fast_path}" + (f"{lm.packed_min_rows}" if lm.fast_path == "prepacked" else "")
        raw += "_compiled" if lm.compile != "none" else ""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw)


def primed_cache(lm: LM, context: int, width: int, rng: random.Random) -> tuple[list[int], KVCache]:
    """Random ids for `context` cached tokens and `width` more, and a cache holding the first `context`."""
    ids = [rng.randrange(lm.vocab_size) for _ in range(context + width)]
    cache = lm.new_cache()
    lm.forward(ids[:context], cache, last_only=True)
    return ids, cache


def timed_forward(lm: LM, ids: list[int], cache: KVCache, context: int, k: int) -> float:
    """Seconds of one forward of k new tokens (ids[context:]) after the `context` cached ones, fed as
    tree/window decoders feed them (explicit positions and a bool mask, logits for every row), or
    (k = 0) of one autoregressive step (1 token, causal, no mask). The cache is cut back after."""
    lm.sync()
    start = time.perf_counter()
    if k == 0:
        lm.forward(ids[context:context + 1], cache, last_only=True)
    else:
        mask = torch.ones(k, context + k, dtype=torch.bool)
        mask[:, context:] = torch.tril(mask[:, context:])
        lm.forward(ids[context:context + k], cache, position_ids=torch.arange(context, context + k), mask=mask,
                   logits_last=k)
    lm.sync()
    elapsed = time.perf_counter() - start
    cache.crop(context)
    return elapsed


def forward_samples(lm: LM, max_tokens: int = 48, context: int = 256, repeats: int = 5,
                    seed: int = 0, sizes: Sequence[int] | None = None) -> dict[int, list[float]]:
    """Seconds of each forward of k = 1..max_tokens new tokens (or of k in `sizes` only) after
    `context` cached ones and (k = 0) of one autoregressive step (timed_forward): `repeats` rounds,
    the sizes visited in a fresh random order each round so that drift spreads over all of them."""
    rng = random.Random(seed)
    ids, cache = primed_cache(lm, context, max_tokens, rng)
    samples: dict[int, list[float]] = {k: [] for k in (0, *(sizes or range(1, max_tokens + 1)))}

    def one(k: int) -> float:
        return timed_forward(lm, ids, cache, context, k)

    for k in (0, 1, max_tokens):  # warm-up: allocator growth, kernel selection
        one(k)
    for _ in range(repeats):
        order = list(samples)
        rng.shuffle(order)
        for k in order:
            samples[k].append(one(k))
    return samples


def kernel_switches(lm: LM) -> tuple[int, ...]:
    """The forward widths (rows) at which `lm`'s linear layers change kernel: the packed path's first
    packed width, our kernel's first width past its largest; none on the native path."""
    if lm.fast_path == "prepacked" and lm.packed_min_rows:
        return (lm.packed_min_rows,)
    if lm.fast_path == "kernel":
        return (kernels.MAX_ROWS + 1,)
    return ()


def fastest_curve(samples: dict[int, list[float]], sizes: Sequence[int], switches: Sequence[int] = ()) -> list[float]:
    """Per size (ascending) its fastest round (other load only ever adds time, so the minimum is the
    least noisy estimate), made non-decreasing in k between kernel switches (more tokens never cost
    less on the same kernels; from a switch on another kernel runs, whose curve starts afresh)."""
    curve, worst = [], 0.0
    for i, k in enumerate(sizes):
        if i and any(sizes[i - 1] < s <= k for s in switches):
            worst = 0.0
        worst = max(worst, min(samples[k]))
        curve.append(worst)
    return curve


def measure_forward_latency(lm: LM, max_tokens: int = 48, context: int = 256,
                            repeats: int = 5) -> tuple[list[float], float]:
    """Seconds of one target forward of k = 1..max_tokens new tokens (fastest_curve) and of one
    autoregressive step (its fastest round), from forward_samples."""
    samples = forward_samples(lm, max_tokens, context, repeats)
    return fastest_curve(samples, range(1, max_tokens + 1), kernel_switches(lm)), min(samples[0])


def forward_latency(lm: LM, cache_dir: str | os.PathLike | None = None, max_tokens: int = 48, context: int = 256,
                    repeats: int = 5, refresh: bool = False) -> dict:
    """The cached latency profile for this device and model (measured when absent, or on refresh).
    Returns {"key", "device", "context", "repeats", "latency_s": [seconds for 1..K tokens],
    "autoregressive_s": seconds of one autoregressive step, ...}."""
    key = profile_key(lm)
    path = Path(cache_dir).expanduser() / "latency" / f"{key}.json" if cache_dir else None
    if path is not None and path.exists() and not refresh:
        profile = json.loads(path.read_text())
        # A profile without its kernel switches was made non-decreasing across them: measured again.
        if ("autoregressive_s" in profile and len(profile["latency_s"]) >= max_tokens and profile["context"] == context
                and profile.get("kernel_switches") == list(kernel_switches(lm))):
            return profile
    latency, autoregressive = measure_forward_latency(lm, max_tokens, context, repeats)
    profile = {"key": key, "device": device_name(lm.device), "torch_threads": torch.get_num_threads(),
               "model": lm.name, "dtype": str(lm.dtype).replace("torch.", ""), "context": context,
               "repeats": repeats, "kernel_switches": list(kernel_switches(lm)), "latency_s": latency,
               "autoregressive_s": autoregressive}
    if path is not None:
        _save_json(path, profile)
    return profile


def step_cost(profile: dict, tokens: float) -> float:
    """Latency of a forward of `tokens` (fractional: a mean) relative to one autoregressive
    step: linear interpolation inside the profile; beyond it, a line fitted to its upper half."""
    latency, unit = profile["latency_s"], profile["autoregressive_s"]
    k = len(latency)
    if tokens <= 1:
        return latency[0] / unit
    if tokens <= k:
        lo = min(int(tokens), k - 1)
        frac = tokens - lo
        return (latency[lo - 1] * (1 - frac) + latency[lo] * frac) / unit
    upper = np.arange(k // 2, k)
    slope = max(0.0, float(np.polyfit(upper + 1, np.asarray(latency)[upper], 1)[0])) if len(upper) > 1 else 0.0
    return (latency[-1] + slope * (tokens - k)) / unit


def _save_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)  # atomic: concurrent sweep jobs never read half a file


CHOICE_SIZES = (2, 4, 8, 16)  # the verification widths the choice weighs beside the 1-token step
PACKED_MIN_ROWS_CHOICES = (1, 2, 4)  # where the packed kernel may start (1: every forward)


def cost(m: dict) -> float:
    """What auto choices minimise, in seconds: one 1-token step + the mean verification forward."""
    return m["autoregressive_s"] + float(np.mean([m[f"k{k}_s"] for k in CHOICE_SIZES]))


def step_costs(lm: LM) -> dict:
    """The seconds cost() weighs, measured: the 1-token step and forwards of CHOICE_SIZES tokens, no
    others (a third of the forwards of the whole curve), 3 rounds each (fastest_curve)."""
    samples = forward_samples(lm, max(CHOICE_SIZES), repeats=3, sizes=CHOICE_SIZES)
    curve = fastest_curve(samples, CHOICE_SIZES, kernel_switches(lm))
    return {"autoregressive_s": min(samples[0]), **{f"k{k}_s": s for k, s in zip(CHOICE_SIZES, curve)}}


def candidate_labels() -> list[str]:
    """What auto measures: the native path, the packed one from 1, 2 or 4 rows up, and our kernel."""
    return ["none"] + [f"prepacked>={m}" for m in PACKED_MIN_ROWS_CHOICES] + ["kernel"]


def parse_candidate(label: str) -> tuple[str, int | None]:
    """"none" -> ("none", None); "prepacked" -> ("prepacked", None: the dtype's default);
    "prepacked>=N" -> ("prepacked", N); "kernel" -> ("kernel", None)."""
    path, _, rows = label.partition(">=")
    if path not in FAST_PATHS or (rows and (path != "prepacked" or not rows.isdigit() or int(rows) < 1)):
        raise ValueError(f"fast path {label!r} is not allowed; use none, prepacked, prepacked>=N (N >= 1) or kernel")
    return path, int(rows) if rows else None


def choose_fast_path(lm: LM, cache_dir: str | os.PathLike | None = None, refresh: bool = False) -> dict:
    """model.fast_path=auto: on CPU, put `lm` on whichever kernel path is fastest on this
    device and model, measured (the 1-token step plus forwards of 2, 4, 8 and 16 new tokens
    after 256 cached ones, each size's fastest of 3 rounds), and cache the choice per device,
    threads, model and dtype. The packed path is measured from 1, 2 and 4 rows up: where oneDNN's
    packed kernel starts to beat the native one depends on the CPU; our kernel too, where this CPU
    has it (its build, once per machine, happens before its timing: kernel_build_s). On CUDA it
    changes nothing.
    Returns the choice ("chosen", "min_rows") with its measurements."""
    if lm.device.type != "cpu":
        lm.set_fast_path("none")
        return {"chosen": "none", "min_rows": None, "why": f"auto changes nothing on {lm.device.type}"}
    path = (Path(cache_dir).expanduser() / "fast_path" / f"{profile_key(lm, fast_path=False)}.json" if cache_dir
            else None)
    if path is not None and path.exists() and not refresh:
        try:
            choice = json.loads(path.read_text())
            # An entry measured over other candidates (made before the kernel path existed, say) or
            # another build of our kernel (a new source, or one this CPU could not take then) is measured
            # again: a stale cache must not keep a new path out of the choice.
            if (choice.get("chosen") in FAST_PATHS and choice.get("candidates") == candidate_labels()
                    and choice.get("kernel_build") == kernels.build_id()
                    and lm.set_fast_path(choice["chosen"], choice["min_rows"]) == choice["chosen"]):
                return choice
        except (OSError, ValueError, TypeError):
            pass  # a damaged cache entry is measured again
    measured, notes = {}, {}
    # Minutes on a real model: a bar on a terminal, or the first run looks hung (none in logs and
    # tests, where stderr must stay one line for bad input).
    for label in tqdm(candidate_labels(), desc=f"model.fast_path=auto: measuring kernels for {lm.name} (once per CPU)",
                      unit="path", disable=None, leave=False):
        candidate, min_rows = parse_candidate(label)
        if lm.set_fast_path(candidate, min_rows) != candidate:
            notes[candidate] = lm.fast_path_note
            continue
        measured[label] = {"path": candidate, "min_rows": min_rows, **step_costs(lm)}
        if candidate == "kernel":
            measured[label]["kernel_build_s"] = round(lm.kernel_build_seconds, 1)  # before, never inside, the timing

    best = measured[min(measured, key=lambda c: cost(measured[c]))]
    lm.set_fast_path(best["path"], best["min_rows"])
    choice = {"chosen": best["path"], "min_rows": best["min_rows"], "device": device_name(lm.device),
              "torch_threads": torch.get_num_threads(), "model": lm.name, "dtype": str(lm.dtype).replace("torch.", ""),
              "candidates": candidate_labels(), "kernel_build": kernels.build_id(), "measured": measured,
              "unavailable": notes,
              "why": "lowest 1-token step + mean of k = " + ", ".join(map(str, CHOICE_SIZES))}
    if path is not None:
        _save_json(path, choice)
    return choice


COMPILE_MARGIN = 0.95  # compile only when it measures at least 5% cheaper than eager: see choose_compile


def _compile_decision(measured: dict, why_eager: str) -> tuple[str, str]:
    """The choice from the two paths' measured costs (`why_eager`: why there is no compiled one)."""
    if "inductor" not in measured:
        return "none", why_eager
    ratio = cost(measured["inductor"]) / cost(measured["none"])
    chosen = "inductor" if ratio <= COMPILE_MARGIN else "none"
    return chosen, (f"compiled step + mean of k = {', '.join(map(str, CHOICE_SIZES))} at {ratio:.2f}x eager's"
                    + ("" if chosen == "inductor" or ratio > 1 else f" (compiled only at {COMPILE_MARGIN}x or less)"))


def choose_compile(lm: LM, cache_dir: str | os.PathLike | None = None, refresh: bool = False) -> dict:
    """model.compile=auto: compile the decode step (inductor) when that measures at least 5% cheaper
    than eager on this device, model, dtype and kernel path (the same cost as the fast-path choice),
    and cache the choice there. The two are measured one after the other, so a smaller difference is
    within a shared CPU's drift (a bf16 choice at 0.99x kept a compiled path whose one-token step a
    later profile put at 1.28x eager's, results/reference/forecast/cpu_cross_dtype/fused/), and a compiled load costs
    minutes. Measuring compiles once (minutes on a CPU); a cached "inductor" compiles at
    every load, its time in compile_seconds, never in a timed run. Set the fast path first.
    Returns the choice ("chosen", "why") with its measurements."""
    lm.set_compile("none")
    path = Path(cache_dir).expanduser() / "compile" / f"{profile_key(lm)}.json" if cache_dir else None
    if path is not None and path.exists() and not refresh:
        try:
            choice = json.loads(path.read_text())
            if "inductor" in choice.get("measured", {}):  # cached under an older rule: decided again by this one
                choice["chosen"], choice["why"] = _compile_decision(choice["measured"], "")
            if choice.get("chosen") in COMPILE_MODES and lm.set_compile(choice["chosen"]) == choice["chosen"]:
                return choice
        except (OSError, ValueError, TypeError):
            pass  # a damaged cache entry is measured again
    with tqdm(total=2, desc=f"model.compile=auto: eager against compiled for {lm.name} (once per device)",
              unit="path", disable=None, leave=False) as bar:
        measured, failed = {"none": step_costs(lm)}, ""
        bar.update()
        try:
            if lm.set_compile("inductor") == "inductor":
                measured["inductor"] = {**step_costs(lm), "compile_s": round(lm.compile_seconds, 1)}
        except Exception as e:  # noqa: BLE001 -- a compiler error on some device: auto is never worse than eager
            lm.set_compile("none")
            failed = f"inductor failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        bar.update()
    chosen, why = _compile_decision(measured, failed or lm.compile_note)
    if chosen == "none":
        lm.set_compile("none")
    choice = {"chosen": chosen, "device": device_name(lm.device), "torch_threads": torch.get_num_threads(),
              "model": lm.name, "dtype": str(lm.dtype).replace("torch.", ""), "fast_path": lm.fast_path,
              "measured": measured, "why": why}
    if path is not None:
        _save_json(path, choice)
    return choice
