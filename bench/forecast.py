"""`python -m bench.forecast RUN_DIR --profile PROFILE [--path P] [--out DIR]`: a run's tokens/s and
speedup forecast for another device, from the run's per-step records and that device's profile.

Why: what a method saves in steps does not depend on the device, what a step costs does. A run's
trace says what each step fed the target (forward_tokens after context_tokens cached ones; the
first step is the prefill) and what its draft did, so the forecast replays the trace at the
profile's prices, record by record:

    decode time = sum over steps of target(forward_tokens, context_tokens) + draft + overhead

PROFILE is one of:
- a directory written by scripts/profile_device.py --out: profile.csv's <path>_ms by tokens (and by
  context where it holds several). A one-token forward costs the autoregressive step (<path>_ms /
  <path>_vs_own_step, the causal unmasked step the baseline takes); between profiled sizes the cost
  is linear, past the largest a line fitted to the upper half (decoders.tuning.profile.step_cost,
  what the auto-tuners use); between contexts linear, outside them the nearest profiled context's.
  The fast path: --path, else the profile's only one, else the run's own (its provenance.json;
  uncompiled for the hf_* peers, whose generate() calls the model's own forward).
- a roofline file (YAML or JSON): device, bandwidth_gb_s, peak_flops (FLOP/s), fixed_ms (per
  forward), bytes_per_param, and optionally step_overhead_ms. A forward of k tokens costs
  max(weight bytes / bandwidth, FLOPs / peak) + fixed_ms, weights and FLOPs from the run's
  model_flops_spec (its provenance.json) by decoders.core.lm.forward_flops; KV-cache reads left out.

The draft, per step (the draft_source column): the profile's curve for the run's draft where it has
one (PROFILE/draft-<run label>/profile.csv, scripts/profile_draft.py's: a step's first depth, which
follows the target's forward; its profile_later.csv, where there, prices every later depth, which
follows another depth and finds the draft in the caches; its step.csv, where there, adds to every
depth the host work a whole drafting step did beyond its depths' curves, host_ms_per_depth: the tree
built between and after them), else a roofline of the
draft's size (with a roofline profile: its parameters are read off the recorded draft FLOPs, 2 per
parameter and token, the smallest over the run's steps), else the run's measured draft_time scaled
by the target's forecast / measured time over the run's decoding steps. A step runs the draft
forwards its info says (draft_forwards, else one per level: draft_depth, else one). A step that fed
no draft forward keeps its measured draft_time: host work (n-gram lookups, tree building), as
overhead is.
Overhead: the profile's step_overhead_ms where it gives one, else the run's overhead_time, step by step.

Speedup: the same forecast of the leaderboard's autoregressive entry (the sibling directory
autoregressive/) on the same prompts, else of one-token steps of the same new tokens after the prompt
(overhead only where the profile gives one), aggregated by bench.metrics.speedups (Spec-Bench's ratio
of mean per-prompt tokens/s). measured_speedup, measured_tokens_per_s and measured_draft_ms (the
draft's time per decoding step, beside the forecast's draft_ms) are the run's own, shown only where
the run was timed on the profile's device (its name, and dtype and threads where the profile
says them). Batched runs (gen.batch_size > 1) are left out: a profile prices one row. Bad input ends
in one line and exit code 2, with nothing written.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import yaml

from decoders.core.fast_path import PACKED_MIN_ROWS
from decoders.core.lm import forward_flops
from decoders.tuning.profile import step_cost

from . import metrics, rundir
from .errors import BenchError, fail
from .leaderboard_tables import prompt_of, run_pairs
from .records import read_records, records_path, run_dirs
from .usage import Parser

ROOFLINE_KEYS = ("device", "bandwidth_gb_s", "peak_flops", "fixed_ms", "bytes_per_param")
PROVENANCE_FILES = ("provenance.json", "profile_provenance.json")  # a profile's: profile_device's, the GPU kit's copy
SAME_DEVICE_KEYS = ("device_name", "dtype", "torch_threads")
TRACE_COLUMNS = ("forward_tokens", "context_tokens", "target_time", "draft_time", "overhead_time",
                 "draft_forward_tokens", "draft_flops")  # what a forecast reads of a record's trace


@dataclass
class Curve:
    """profile_device's cost of one forward: ms_by_context[context][k - 1] for k = 1..K new tokens,
    k = 1 being the autoregressive step."""
    ms_by_context: dict[int, list[float]]

    def forward_ms(self, tokens: float, context: float) -> float:
        contexts = sorted(self.ms_by_context)
        costs = [step_cost({"latency_s": self.ms_by_context[c], "autoregressive_s": 1.0}, tokens) for c in contexts]
        return float(np.interp(context, contexts, costs))


@dataclass
class Roofline:
    """A device as two ceilings and a fixed cost per forward."""
    bandwidth_bytes_per_s: float
    peak_flops: float
    fixed_ms: float
    bytes_per_param: float
    source: str = "the roofline"  # its file, for messages

    def forward_ms(self, flops: float, params: float) -> float:
        ms = 1e3 * max(params * self.bytes_per_param / self.bandwidth_bytes_per_s, flops / self.peak_flops) \
            + self.fixed_ms
        if not math.isfinite(ms):  # finite inputs can still overflow: a forecast never prints inf or nan
            raise BenchError(f"{self.source} prices a forward of {flops:.4g} FLOPs and {params:.4g} parameters at "
                             f"{ms} ms (bandwidth_gb_s {self.bandwidth_bytes_per_s / 1e9:.4g}, peak_flops "
                             f"{self.peak_flops:.4g}, bytes_per_param {self.bytes_per_param:.4g}, fixed_ms "
                             f"{self.fixed_ms:.4g}); give figures a device has")
        return ms

    def model_forward_ms(self, spec: dict, tokens: float, context: float) -> float:
        """One forward of a model of flops spec `spec` (LM.flops_spec(): matmul_params, n_layers, d_attn):
        `tokens` new tokens after `context` cached ones, its weights read once, its FLOPs by forward_flops."""
        return self.forward_ms(forward_flops(spec, tokens, context), spec["matmul_params"])


@dataclass
class Profile:
    source: Path
    device: str
    info: dict  # the profile's provenance (device_name, dtype, torch_threads, model_flops_spec); {} if none
    curves: dict[str, Curve] = field(default_factory=dict)  # fast path -> curve (a profile_device directory)
    roofline: Roofline | None = None
    step_overhead_ms: float | None = None
    drafts: dict[str, dict[str, Curve]] = field(default_factory=dict)  # run label -> fast path -> the draft's curve
    drafts_later: dict[str, dict[str, Curve]] = field(default_factory=dict)  # the same for a step's later depths
    drafts_host: dict[str, dict[int, float]] = field(default_factory=dict)  # run label -> context -> host ms a depth


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def _numbers(table: pd.DataFrame, column: str, where: Path) -> np.ndarray:
    """A profile.csv column: finite numbers, > 0 (a context >= 0)."""
    values = pd.to_numeric(table[column], errors="coerce").to_numpy(float)
    low_ok = values >= 0 if column == "context" else values > 0
    if not len(values) or not np.all(np.isfinite(values) & low_ok):
        raise BenchError(f"{where}: column {column} must hold numbers {'>= 0' if column == 'context' else '> 0'} in "
                         "every row; scripts/profile_device.py --out writes it")
    return values


def read_curves(csv: Path) -> dict[str, Curve]:
    """Every fast path's curve in a profile_device profile.csv (columns tokens, <path>_ms, optionally
    <path>_vs_own_step and context), made dense in k = 1..K by linear interpolation."""
    try:
        table = pd.read_csv(csv)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read {csv} as CSV ({e}); give a directory written by "
                         "scripts/profile_device.py --out") from None
    paths = [c[:-3] for c in table.columns if c.endswith("_ms")]
    if "tokens" not in table or not paths:
        raise BenchError(f"{csv} needs a tokens column and a <path>_ms column (it has {', '.join(table.columns)}); "
                         "scripts/profile_device.py --out writes them")
    tokens = _numbers(table, "tokens", csv).astype(int)
    contexts = _numbers(table, "context", csv).astype(int) if "context" in table else np.zeros(len(table), int)
    curves = {}
    for path in paths:
        ms = _numbers(table, f"{path}_ms", csv)
        own = _numbers(table, f"{path}_vs_own_step", csv) if f"{path}_vs_own_step" in table else None
        by_context = {}
        for context in sorted(set(contexts)):
            rows = contexts == context
            points = dict(zip(tokens[rows], ms[rows]))
            if own is not None:  # the autoregressive step this block was measured against
                points[1] = float(ms[rows][0] / own[rows][0])
            if 1 not in points:
                raise BenchError(f"{csv}: {path} has no one-token cost (a tokens=1 row or a {path}_vs_own_step "
                                 "column); scripts/profile_device.py --out writes both")
            ks = sorted(points)
            by_context[int(context)] = list(np.interp(np.arange(1, ks[-1] + 1), ks, [points[k] for k in ks]))
        curves[path] = Curve(by_context)
    return curves


def read_host_ms(csv: Path) -> dict[int, float]:
    """scripts/profile_draft.py's step.csv: host_ms_per_depth by context (it may be below 0 where the
    host work is within the curves' noise)."""
    try:
        table = pd.read_csv(csv)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read {csv} as CSV ({e}); scripts/profile_draft.py writes it") from None
    if not {"context", "host_ms_per_depth"} <= set(table.columns):
        raise BenchError(f"{csv} needs context and host_ms_per_depth columns (it has {', '.join(table.columns)}); "
                         "scripts/profile_draft.py writes them")
    contexts = _numbers(table, "context", csv).astype(int)
    host = pd.to_numeric(table["host_ms_per_depth"], errors="coerce").to_numpy(float)
    if not len(host) or not np.all(np.isfinite(host)):
        raise BenchError(f"{csv}: column host_ms_per_depth must hold numbers in every row; "
                         "scripts/profile_draft.py writes it")
    return dict(zip(contexts.tolist(), host.tolist()))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read {path} as JSON ({e}); give the file as written, or remove it") from None
    return data if isinstance(data, dict) else {}


def _provenance(directory: Path, names: tuple[str, ...] = ("provenance.json",)) -> dict:
    found = [directory / name for name in names if (directory / name).is_file()]
    return _read_json(found[0]) if found else {}


def _number(value) -> float | None:
    """A finite number, or None; a string is read as one (PyYAML reads 9.89e14, without a dot before
    the e or a sign after it, as a string)."""
    try:
        number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def read_roofline(path: Path) -> Profile:
    """A roofline file: ROOFLINE_KEYS (and optionally step_overhead_ms), YAML or JSON."""
    allowed = f"a roofline file gives {', '.join(ROOFLINE_KEYS)} (step_overhead_ms optional)"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise BenchError(f"cannot read {path} as YAML or JSON ({type(e).__name__}); {allowed}") from None
    if not isinstance(data, dict):
        raise BenchError(f"{path} is not a mapping of keys; {allowed}")
    missing = [k for k in ROOFLINE_KEYS if k not in data]
    if missing:
        raise BenchError(f"{path} lacks {', '.join(missing)}; {allowed}")
    unknown = sorted(set(data) - set(ROOFLINE_KEYS) - {"step_overhead_ms"})
    if unknown:
        raise BenchError(f"{path} has unknown key {unknown[0]}; {allowed}")
    numbers = {key: _number(data.get(key, 0.0)) for key in (*ROOFLINE_KEYS[1:], "step_overhead_ms")}
    for key, value in numbers.items():
        time = key.endswith("_ms")  # times may be 0, rates and sizes may not
        if value is None or value < 0 or (value == 0 and not time):
            raise BenchError(f"{path}: {key} must be a number {'>= 0' if time else '> 0'}, not {data.get(key)!r}; "
                             f"{allowed}")
    data.update((k, v) for k, v in numbers.items() if k in data)
    roofline = Roofline(data["bandwidth_gb_s"] * 1e9, float(data["peak_flops"]), float(data["fixed_ms"]),
                        float(data["bytes_per_param"]), source=str(path))
    return Profile(path, str(data["device"]), {"device_name": str(data["device"])}, roofline=roofline,
                   step_overhead_ms=data.get("step_overhead_ms"))


def load_profile(path: Path) -> Profile:
    """A profile_device output directory (profile.csv, its provenance, draft-<label>/ profiles) or a
    roofline file."""
    path = Path(path)
    if not path.exists():
        raise BenchError(f"--profile {path} does not exist; give a directory written by scripts/profile_device.py "
                         f"--out, or a roofline file (YAML or JSON: {', '.join(ROOFLINE_KEYS)})")
    if path.is_file():
        return read_roofline(path)
    if not (path / "profile.csv").is_file():
        raise BenchError(f"--profile {path} holds no profile.csv; give a directory written by "
                         "scripts/profile_device.py --out, or a roofline file")
    info = _provenance(path, PROVENANCE_FILES)
    overhead = info.get("step_overhead_ms")
    drafts, later = ({d.name.removeprefix("draft-"): read_curves(d / name)
                      for d in sorted(path.glob("draft-*")) if (d / name).is_file()}
                     for name in ("profile.csv", "profile_later.csv"))
    host = {d.name.removeprefix("draft-"): read_host_ms(d / "step.csv")
            for d in sorted(path.glob("draft-*")) if (d / "step.csv").is_file()}
    return Profile(path, info.get("device_name", "unknown device"), info, read_curves(path / "profile.csv"),
                   step_overhead_ms=float(overhead) if overhead is not None else None, drafts=drafts,
                   drafts_later=later, drafts_host=host)


def pick_path(curves: dict[str, Curve], info: dict, chosen: str | None, where: Path, compiled: bool = True) -> str:
    """--path if given; else the profile's only path; else the run's own fast path (provenance.json),
    compiled where the run's was. Where `compiled` is False, a compiled path's uncompiled twin if profiled."""
    if chosen is not None:
        eager = chosen.removesuffix("+inductor")
        if not compiled and eager in curves:
            return eager
        if chosen not in curves:
            raise BenchError(f"--path {chosen} is not in {where} (it profiles {', '.join(curves)})")
        return chosen
    if len(curves) == 1:
        return next(iter(curves))
    suffix = "+inductor" if compiled and info.get("compile") == "inductor" else ""
    wanted = ["none"]
    if info.get("fast_path") == "prepacked":
        rows = info.get("packed_min_rows")
        default = {str(k).replace("torch.", ""): v for k, v in PACKED_MIN_ROWS.items()}.get(info.get("dtype"))
        wanted = [f"prepacked>={rows}"] + (["prepacked"] if rows == default else [])
    elif info.get("fast_path") == "kernel":
        wanted = ["kernel"]
    for label in (w + suffix for w in wanted):
        if label in curves:
            return label
    raise BenchError(f"{where} profiles several fast paths ({', '.join(curves)}) and the run's "
                     f"({wanted[0] + suffix if info else 'unknown: no provenance.json'}) is not among them; "
                     "choose one with --path")


@dataclass
class Run:
    directory: Path
    records: list[dict]  # status ok, with a trace
    info: dict  # provenance.json: the run's own, else its leaderboard's (up to two levels up)

    @property
    def label(self) -> str:
        return self.directory.name


def load_run(directory: Path) -> Run:
    records = [r for r in read_records(records_path(directory))
               if r["status"] == "ok" and all(c in (r.get("trace") or {}) for c in TRACE_COLUMNS)]
    info = next((p for d in (directory, directory.parent, directory.parent.parent) if (p := _provenance(d))), {})
    return Run(directory, records, info)


def batched(run: Run) -> bool:
    return any(isinstance(r.get("batch"), dict) and r["batch"].get("size", 1) > 1 for r in run.records)


def draft_forwards(trace: dict, i: int) -> int:
    """Sequential draft forwards in step i: as many as the proposer ran where it says (EAGLE's
    draft_forwards: its drafting may go deeper than the tree it keeps), else one per level of the tree
    drafted; none where nothing was fed to one."""
    if not trace["draft_forward_tokens"][i]:
        return 0
    info = trace["info"][i] if i < len(trace.get("info") or []) else {}
    return max(1, int(info.get("draft_forwards") or info.get("draft_depth") or 1))


@dataclass
class Prices:
    """What one run's steps cost on the profile's device, in ms."""
    target_ms: Callable[[float, float], float]  # (forward tokens, cached tokens) -> ms
    target_source: str
    draft_ms: Callable[[dict, int], float] | None = None  # (trace, step with draft forwards) -> ms
    draft_source: str = "none"
    overhead_ms: float | None = None  # per step; None: the run's own overhead_time


def target_prices(run: Run, profile: Profile, fast_path: str | None) -> Prices:
    if profile.roofline is None:
        # transformers' generate (the hf_* peers) calls the model's own forward: the fast path's linear
        # layers, never the compiled step
        eager = run.records[0]["decoder"].startswith("hf_")
        label = pick_path(profile.curves, run.info, fast_path, profile.source, compiled=not eager)
        return Prices(profile.curves[label].forward_ms, label, overhead_ms=profile.step_overhead_ms)
    spec = run.info.get("model_flops_spec")
    if not spec:
        raise BenchError(f"--profile {profile.source} is a roofline, which needs the target's model_flops_spec from "
                         f"a provenance.json (python -m bench writes it); none in {run.directory} or the two "
                         "directories above it")
    roofline = profile.roofline
    return Prices(lambda tokens, context: roofline.model_forward_ms(spec, tokens, context),
                  "roofline", overhead_ms=profile.step_overhead_ms)


def decode_target_ms(run: Run, prices: Prices) -> tuple[float, float]:
    """The target's forecast and measured ms summed over the run's decoding steps (prefill out)."""
    forecast = measured = 0.0
    for r in run.records:
        t = r["trace"]
        forecast += sum(prices.target_ms(k, c) for k, c in zip(t["forward_tokens"][1:], t["context_tokens"][1:]))
        measured += 1e3 * sum(t["target_time"][1:])
    return forecast, measured


def add_draft_prices(prices: Prices, run: Run, profile: Profile, fast_path: str | None) -> Prices:
    """The draft's cost, from the first source that has it (module docstring)."""
    steps = [(r["trace"], i) for r in run.records for i in range(len(r["trace"]["committed"]))
             if draft_forwards(r["trace"], i)]
    if not steps:
        prices.draft_source = "none (host work as measured)"
        return prices
    if run.label in profile.drafts:
        curves = profile.drafts[run.label]
        # the draft is never compiled (scripts/profile_draft.py): a compiled path's uncompiled twin
        label = pick_path(curves, run.info, fast_path, profile.source / f"draft-{run.label}", compiled=False)
        first = curves[label]
        later = profile.drafts_later.get(run.label, {}).get(label, first)
        host = profile.drafts_host.get(run.label, {})
        host_contexts = sorted(host)
        host_ms = [host[c] for c in host_contexts]

        def from_curve(t, i):  # n depths of draft_forward_tokens / n rows each: the first, then n - 1 later ones
            n = draft_forwards(t, i)
            rows, context = t["draft_forward_tokens"][i] / n, t["context_tokens"][i]
            host_here = float(np.interp(context, host_contexts, host_ms)) if host else 0.0
            return first.forward_ms(rows, context) + (n - 1) * later.forward_ms(rows, context) + n * host_here
        prices.draft_ms = from_curve
        parts = [name for name, there in (("first, later depths", later is not first), ("host work", host)) if there]
        prices.draft_source = f"profile draft-{run.label}" + (f" ({'; '.join(parts)})" if parts else "")
    elif profile.roofline is not None:
        per_token = [t["draft_flops"][i] / t["draft_forward_tokens"][i] for t, i in steps if t["draft_flops"][i]]
        params = min(per_token, default=0.0) / 2  # 2 FLOPs per parameter and token (metrics' FLOP count)
        roofline = profile.roofline

        def from_roofline(t, i):
            n = draft_forwards(t, i)
            return n * roofline.forward_ms(t["draft_flops"][i] / n, params)
        prices.draft_ms, prices.draft_source = from_roofline, f"roofline ({params / 1e6:.3g}M params)"
    else:
        forecast, measured = decode_target_ms(run, prices)
        scale = forecast / measured if measured > 0 else 1.0
        prices.draft_ms = lambda t, i: 1e3 * t["draft_time"][i] * scale
        prices.draft_source = f"measured x {scale:.3g}"
    return prices


def forecast_trace(trace: dict, prices: Prices) -> dict:
    """One record's forecast: seconds in all, and ms summed over its decoding steps by part."""
    parts = {"target_ms": 0.0, "draft_ms": 0.0, "overhead_ms": 0.0}
    total_ms = 0.0
    for i, (k, c) in enumerate(zip(trace["forward_tokens"], trace["context_tokens"])):
        target = prices.target_ms(k, c)
        measured_draft = 1e3 * trace["draft_time"][i] if "draft_time" in trace else 0.0
        draft = prices.draft_ms(trace, i) if prices.draft_ms is not None and draft_forwards(trace, i) \
            else measured_draft
        overhead = prices.overhead_ms if prices.overhead_ms is not None else 1e3 * trace["overhead_time"][i]
        total_ms += target + draft + overhead
        if i:  # decoding steps: the prefill left out, as metrics.decode_step_ms does
            for name, value in zip(parts, (target, draft, overhead)):
                parts[name] += value
    return {"latency_s": total_ms / 1e3, "decode_steps": len(trace["forward_tokens"]) - 1, **parts}


def one_token_trace(record: dict) -> dict:
    """Autoregressive decoding of the record's new tokens (its reference's, where it has one): the prompt's
    prefill, then one token a step; no draft, and no overhead unless the profile gives one."""
    new = (record.get("reference") or {}).get("new_tokens", record["new_tokens"])
    prompt = record.get("prompt_tokens") or record["trace"]["forward_tokens"][0]
    steps = max(new, 1)
    return {"forward_tokens": [prompt] + [1] * (steps - 1),
            "context_tokens": [0] + [prompt + i for i in range(1, steps)],
            "draft_forward_tokens": [0] * steps, "draft_time": [0.0] * steps, "overhead_time": [0.0] * steps}


def same_device(run_info: dict, profile_info: dict) -> bool:
    """The run was timed on the profile's device: the same name, and dtype and threads where the profile says them."""
    return bool(run_info.get("device_name")) and all(
        run_info.get(k) == profile_info[k] for k in SAME_DEVICE_KEYS if k in profile_info)


def forecast_run(run: Run, reference: Run | None, profile: Profile, fast_path: str | None) -> dict:
    """One table row: the run's forecast, its autoregressive reference's, and what was measured."""
    prices = add_draft_prices(target_prices(run, profile, fast_path), run, profile, fast_path)
    ref_records = {prompt_of(r): r for r in reference.records} if reference is not None else {}
    ref_prices = target_prices(reference, profile, fast_path) if reference is not None else None
    ar_prices = Prices(prices.target_ms, prices.target_source, overhead_ms=profile.step_overhead_ms or 0.0)
    mine, pairs, measured_pairs, from_entry = [], [], [], 0
    for r in run.records:
        f = {"new_tokens": r["new_tokens"], **forecast_trace(r["trace"], prices)}
        ref = ref_records.get(prompt_of(r))
        if ref is not None:
            from_entry += 1
            ar = forecast_trace(ref["trace"], ref_prices)
            measured_pairs.append((r, ref))
        else:
            ar = forecast_trace(one_token_trace(r), ar_prices)
            if r.get("reference"):
                measured_pairs.append((r, r["reference"]))
        mine.append(f)
        pairs.append((f, {"new_tokens": (ref or r.get("reference") or r)["new_tokens"], **ar}))
    steps = sum(f["decode_steps"] for f in mine)
    per_step = {name: _ratio(sum(f[name] for f in mine), steps)
                for name in ("target_ms", "draft_ms", "overhead_ms")}
    ar_steps = sum(a["decode_steps"] for _, a in pairs)
    timed_here = same_device(run.info, profile.info)
    return {
        "dataset": run.records[0].get("dataset"), "run": run.label, "decoder": run.records[0]["decoder"],
        "prompts": len(mine),
        "measured_speedup": (metrics.speedups(run_pairs(measured_pairs))["speedup"]
                             if timed_here and measured_pairs else math.nan),
        "forecast_speedup": metrics.speedups(pairs)["speedup"],
        "forecast_tokens_per_s": metrics.pooled_tokens_per_s(mine),
        "measured_tokens_per_s": (metrics.pooled_tokens_per_s(
            {"new_tokens": r["new_tokens"] * len(metrics.timed_runs(r)), "latency_s": sum(metrics.timed_runs(r))}
            for r in run.records) if timed_here else math.nan),
        "mean_accepted_tokens": metrics.mean_accepted_tokens(run.records),
        **per_step,
        "measured_draft_ms": (_ratio(sum(1e3 * sum(r["trace"]["draft_time"][1:]) for r in run.records), steps)
                              if timed_here else math.nan),
        "step_ms": sum(per_step.values()),
        "ar_step_ms": _ratio(sum(a["target_ms"] + a["draft_ms"] + a["overhead_ms"] for _, a in pairs), ar_steps),
        "target_source": prices.target_source,
        "draft_source": prices.draft_source,
        "reference": ("autoregressive entry" if from_entry == len(mine) else "one-token steps" if not from_entry
                      else f"autoregressive entry for {from_entry} of {len(mine)}, one-token steps for the rest"),
    }


def find_runs(run_dir: Path) -> list[Run]:
    if not run_dir.exists():
        raise BenchError(f"{run_dir} does not exist; give a run directory written by python -m bench, or a "
                         "directory of runs (a leaderboard's)")
    found = run_dirs(run_dir.parent if run_dir.is_file() else run_dir)
    if not found:
        raise BenchError(f"no run directories (with records.jsonl or records.jsonl.gz) under {run_dir}; give a run "
                         "directory written by python -m bench, or a directory of runs (a leaderboard's)")
    runs = []
    for d in found:
        run = load_run(d)
        if not run.records:
            print(f"warning: {d} has no finished records with a per-step trace ({', '.join(TRACE_COLUMNS)}): "
                  "left out", file=sys.stderr)
        elif batched(run):
            print(f"warning: {d} ran batched (gen.batch_size > 1): left out, a profile prices one row", file=sys.stderr)
        else:
            runs.append(run)
    if not runs:
        raise BenchError(f"no finished records with per-step traces under {run_dir} (unbatched runs of "
                         "python -m bench write them)")
    return runs


def reference_for(run: Run, loaded: dict[Path, Run]) -> Run | None:
    """The leaderboard's autoregressive entry beside the run (autoregressive/), or the run itself if it is one."""
    if run.records[0]["decoder"] == "autoregressive":
        return run
    sibling = run.directory.parent / "autoregressive"
    if sibling not in loaded and records_path(sibling).is_file():
        loaded[sibling] = load_run(sibling)
    ref = loaded.get(sibling)
    return ref if ref is not None and ref.records and ref.records[0]["decoder"] == "autoregressive" else None


def forecast(runs: list[Run], profile: Profile, fast_path: str | None = None) -> pd.DataFrame:
    """One row per run (find_runs)."""
    loaded = {run.directory: run for run in runs}
    return pd.DataFrame([forecast_run(run, reference_for(run, loaded), profile, fast_path) for run in runs])


def notes(table: pd.DataFrame, profile: Profile, runs: list[Run], run_dir: Path) -> list[str]:
    """What a reader needs to judge the table: the profile, and where it differs from the runs."""
    kind = "roofline" if profile.roofline is not None else "profile_device output"
    lines = [f"Forecast of {run_dir} on {profile.device} ({kind} {profile.source}); bench/forecast.py says how."]
    for key, name in (("model_flops_spec", "model shape"), ("dtype", "dtype")):
        theirs = profile.info.get(key)
        ours = {json.dumps(r.info.get(key), sort_keys=True) for r in runs if r.info.get(key) is not None}
        if theirs is not None and ours and ours != {json.dumps(theirs, sort_keys=True)}:
            lines.append(f"The profile's {name} ({theirs}) is not the runs' ({', '.join(sorted(ours))}): the runs' "
                         "steps are priced at the profile's model.")
    if table["measured_speedup"].isna().all():
        lines.append("measured_* are blank: no run was timed on the profile's device.")
    return lines


def to_markdown(table: pd.DataFrame) -> str:
    return table.to_markdown(index=False, floatfmt=".4g")


def main(argv: list[str] | None = None) -> None:
    parser = Parser(__doc__, prog="python -m bench.forecast")
    parser.add_argument("run_dir", help="a run directory, or a directory of runs (a leaderboard's)")
    parser.add_argument("--profile", required=True,
                        help="a scripts/profile_device.py --out directory, or a roofline file (YAML or JSON)")
    parser.add_argument("--path", help="the profile's fast path to price the target at (default: the run's)")
    parser.add_argument("--out", help="directory for forecast.csv and forecast.md")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(Path(args.profile))
        runs = find_runs(Path(args.run_dir))
        table = forecast(runs, profile, args.path)
        md = "\n".join(notes(table, profile, runs, Path(args.run_dir))) + "\n\n" + to_markdown(table)
        # written before printing: a bad --out fails before any output
        written = rundir.write_report(Path(args.out), "forecast", table, md) if args.out else []
    except BenchError as e:
        fail(e)
    rundir.print_report(md, written)


if __name__ == "__main__":
    main()
