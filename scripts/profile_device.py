"""This device's forward cost curves, one per fast path, side by side: the latency of a forward of
k = 1..K new tokens (tree-style: mask and positions, after --context cached tokens) relative to
one autoregressive step, and how close the 1-token step is to its floor: the model's weights read
once at this machine's measured read bandwidth (a read-only stream). A path ending in +inductor
is that path with model.compile=inductor (compiled first; its compile time is printed apart).

    python scripts/profile_device.py [--max-tokens 64] [--repeats 5] [--context 256[,1024...]] [--refresh]
        [--out DIR] [--paths none,prepacked>=1,kernel,...] [--interleave ROUNDS] [--split 1,8,16,32]
        [hydra overrides...]
    python scripts/profile_device.py --replot DIR      (DIR/profile.png again from its profile.csv)

Profiles are cached under cache_dir/latency/, keyed by device, CPU threads, model, dtype,
attention kernel and fast path: lookahead's `auto` W/N/G, Sequoia's tree=auto and Medusa's
choices=auto divide by the one of the path the run uses. --out writes the table (CSV), the
plot and provenance.json there (results/reference/fast_path/ holds the README's). Several
--context values (a forecast of long answers needs the cost at the contexts they reach,
bench/forecast.py) measure each context in turn: profile.csv then gains a context column, a block
of rows per context, each relative to its own context's step (only the first context is cached,
plotted and in provenance.json's autoregressive_s); a single --context writes what it always did.

--interleave ROUNDS compares the paths side by side on a busy machine: each path on its own copy
of the model, loaded and packed (and built: kernel_build_seconds) before any timing, then ROUNDS
rounds, each visiting every path in turn (the order rotating) for one forward of every size; each
size's median over the rounds (the *_ms columns; *_min_ms its fastest) is reported, nothing cached;
with several --context values, the rounds of each context in turn.

--split SIZES says what holds each forward back: on each eager path, forwards of those widths and the
autoregressive step are split into linears, attention and the rest, the linears set against the read
bandwidth and a large matmul's rate (decoders/tuning/forward_split.py; split.csv with --out).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from bench import provenance
from bench.__main__ import script_args
from bench.plotting import entry_styles, legend_beside, pyplot, save, setup, setup_of, title
from bench.usage import Parser
from decoders.tuning.profile import (
    candidate_labels, forward_latency, measure_forward_latency, parse_candidate, profile_key)

CONF = Path(__file__).resolve().parent.parent / "conf"


def fastest(op, repeats: int, device: torch.device) -> float:
    """Seconds of the fastest of `repeats` calls of op(), after one warm-up call (a GPU's queue
    drained before and after each: its kernels run asynchronously)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        op()
        sync()
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes moved per second (read + written) on `device` by copying a buffer much larger than the caches."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / fastest(lambda: dst.copy_(src), repeats, device)


def read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes read per second on `device` by a read-only stream (a sum over a buffer much larger than
    the caches, on the run's threads): what a step that reads each weight once can at best go at."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    return src.numel() * 4 / fastest(src.sum, repeats, device)


STEP_GOAL = 1.3  # the 1-token step's goal: within 1.3x of its weight-read floor


def parse_args() -> tuple[argparse.Namespace, list[str], list[tuple[str, tuple]]]:
    """This script's options, the Hydra overrides after them, and each --paths entry with its fast-path choice."""
    parser = Parser(__doc__, prog="python scripts/profile_device.py", overrides=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", default="256",
                        help="cached tokens before each forward; several, comma-separated, profile each in turn")
    parser.add_argument("--paths", default=",".join(candidate_labels()),
                        help="fast paths to profile, comma-separated: none, "
                             "prepacked (its default threshold), prepacked>=N, kernel; +inductor: compiled too")
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    parser.add_argument("--out", help="also write profile.csv, profile.png and provenance.json here")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="measure the paths in turn, ROUNDS rounds, and report medians (nothing cached)")
    parser.add_argument("--replot", metavar="DIR", help="only draw DIR/profile.png again from the profile.csv and "
                        "provenance.json an --out run wrote there (alone: nothing is measured)")
    parser.add_argument("--split", default="", metavar="SIZES",
                        help="also split forwards of these widths (comma-separated, e.g. 1,8,16,32) on each eager "
                             "path into linears, attention and the rest, the linears set against the read "
                             "bandwidth and a large matmul's rate: what holds each back (split.csv with --out)")
    args, overrides = script_args(parser)
    paths = [p for p in args.paths.split(",") if p]
    try:
        choices = [(p, parse_candidate(p.removesuffix("+inductor"))) for p in paths]
    except ValueError as e:
        parser.error(str(e))
    contexts = args.context.split(",")
    if not all(c.strip().isdigit() and int(c) >= 1 for c in contexts):
        parser.error(f"--context {args.context}: give cached-token counts >= 1, comma-separated (e.g. 256,1024)")
    args.contexts = list(dict.fromkeys(int(c) for c in contexts))
    sizes = [c for c in args.split.split(",") if c.strip()]
    if not all(c.strip().isdigit() and int(c) >= 1 for c in sizes):
        parser.error(f"--split {args.split}: give forward widths >= 1, comma-separated (e.g. 1,8,16,32)")
    args.split = [int(c) for c in sizes]
    args.context = args.contexts[0]  # the one cached, plotted and in provenance.json's autoregressive_s
    return args, overrides, choices


@dataclass
class Profiles:
    """Per fast path measured: latency of a forward of 1..--max-tokens tokens, the autoregressive
    step, the cached profile's key and (+inductor) the compile time."""
    curves: dict[str, list[float]] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    compile_s: dict[str, float] = field(default_factory=dict)
    fastest: dict[str, list[float]] = field(default_factory=dict)  # --interleave: each size's fastest round
    fastest_steps: dict[str, float] = field(default_factory=dict)  # --interleave: the step's fastest round
    rounds: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # --interleave: every sample
    other_contexts: dict[int, "Profiles"] = field(default_factory=dict)  # --context's further values: curves, steps


def profile_paths(lm, cache_dir: str, args: argparse.Namespace, choices: list[tuple[str, tuple]]) -> Profiles:
    """Each fast path's profile (cached under cache_dir/latency/); a path the model cannot take is skipped."""
    profiles = Profiles()
    for path, choice in choices:
        lm.set_compile("none")  # before the kernels change: a graph is traced over them
        if not put_on_path(lm, path, choice, profiles):
            continue
        profile = forward_latency(lm, cache_dir, args.max_tokens, args.context, args.repeats, refresh=args.refresh)
        profiles.curves[path] = profile["latency_s"][:args.max_tokens]  # a longer cached profile serves a shorter ask
        profiles.steps[path], profiles.keys[path] = profile["autoregressive_s"], profile["key"]
        for context in args.contexts[1:]:  # not cached: the cache keeps one context, the one tuners read
            other = profiles.other_contexts.setdefault(context, Profiles())
            other.curves[path], other.steps[path] = measure_forward_latency(lm, args.max_tokens, context, args.repeats)
    return profiles


def put_on_path(lm, path: str, choice: tuple, profiles: Profiles) -> bool:
    """Set `lm` on `path` (its fast path, then inductor where the path names it), saying what the kernel
    build and the compile took (apart from every timing; the compile's seconds kept in profiles);
    False, with the reason printed, where the model cannot take the path."""
    if lm.set_fast_path(*choice) != choice[0]:
        print(f"{path}: skipped ({lm.fast_path_note})")
        return False
    if lm.fast_path == "kernel":
        built = lm.kernel_build_seconds
        print(f"{path}: kernel extension {f'built in {built:.1f} s' if built else 'loaded from torch_extensions'} "
              "(not in any timing)")
    if path.endswith("+inductor"):
        if lm.set_compile("inductor") != "inductor":
            print(f"{path}: skipped ({lm.compile_note})")
            return False
        profiles.compile_s[path] = lm.compile_seconds
        print(f"{path}: compiled in {profiles.compile_s[path]:.1f} s (not in any timing)")
    return True


def profile_interleaved(cfg, args: argparse.Namespace, choices: list[tuple[str, tuple]]):
    """--interleave: every path on its own copy of the model, set up before any timing; then rounds of
    one forward of every size per path, the paths visited in a rotating order. Returns the Profiles
    (medians per size, fastest apart) and the first path's model (for the floor and provenance)."""
    import statistics

    from decoders.tuning.profile import forward_samples

    models = {}
    profiles = Profiles()
    for path, choice in choices:
        lm = instantiate(cfg.model, fast_path="none", compile="none").load()
        if not put_on_path(lm, path, choice, profiles):
            continue
        models[path] = lm
        profiles.keys[path] = profile_key(lm)
    paths = list(models)
    for c, context in enumerate(args.contexts):
        into = profiles if c == 0 else profiles.other_contexts.setdefault(context, Profiles())
        rounds = {path: {k: [] for k in range(args.max_tokens + 1)} for path in paths}
        for r in range(args.interleave):
            for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                samples = forward_samples(models[path], args.max_tokens, context, repeats=1, seed=r)
                for k, seconds in samples.items():
                    rounds[path][k] += seconds
            print(f"context {context}, round {r + 1}/{args.interleave}: " + ", ".join(
                f"{p} {statistics.median(rounds[p][0]) * 1e3:.1f} ms" for p in paths), flush=True)
        for path in paths:
            into.curves[path] = [statistics.median(rounds[path][k]) for k in range(1, args.max_tokens + 1)]
            into.steps[path] = statistics.median(rounds[path][0])
            into.fastest[path] = [min(rounds[path][k]) for k in range(1, args.max_tokens + 1)]
            into.fastest_steps[path], into.rounds[path] = min(rounds[path][0]), rounds[path]
    return profiles, models[paths[0]]


def latency_table(profiles: Profiles, max_tokens: int) -> pd.DataFrame:
    """Per path: ms by tokens, relative to its own 1-token step and to the native (none) path's."""
    steps = profiles.steps
    base = steps["none"] if "none" in steps else next(iter(steps.values()))
    table = pd.DataFrame({"tokens": range(1, max_tokens + 1)})
    for path, latency in profiles.curves.items():
        table[f"{path}_ms"] = [s * 1e3 for s in latency]
        table[f"{path}_vs_own_step"] = [s / steps[path] for s in latency]
        table[f"{path}_vs_native_step"] = [s / base for s in latency]
        if path in profiles.fastest:
            table[f"{path}_min_ms"] = [s * 1e3 for s in profiles.fastest[path]]
    return table


@dataclass
class Floor:
    """The 1-token step's floor: the model's weights read once at the measured read bandwidth."""
    weight_bytes: int
    copy_bandwidth: float  # bytes per second moved (read + written) by a copy
    read_bandwidth: float  # bytes per second of a read-only stream

    @property
    def seconds(self) -> float:
        return self.weight_bytes / self.read_bandwidth


def measure_floor(lm) -> Floor:
    weight_bytes = lm.flops_spec()["matmul_params"] * lm.model.get_input_embeddings().weight.element_size()
    return Floor(weight_bytes, copy_bandwidth(lm.device), read_bandwidth(lm.device))


def print_steps_against_floor(lm, args: argparse.Namespace, steps: dict[str, float], floor: Floor,
                              fastest: dict[str, float] | None = None) -> None:
    """The floor, and each path's 1-token step against it and against the memory-copy bandwidth."""
    how = (f"median of {args.interleave} interleaved rounds" if args.interleave
           else f"fastest of {args.repeats} rounds")
    print(f"{lm.name}, {str(lm.dtype).replace('torch.', '')}, {torch.get_num_threads()} threads, "
          f"{args.context} cached tokens, {how} per size; "
          f"weights {floor.weight_bytes / 1e6:.0f} MB, read once at {floor.read_bandwidth / 1e9:.1f} GB/s "
          f"(read-only stream) in {floor.seconds * 1e3:.1f} ms: the step's floor")
    for path, step in steps.items():
        read = floor.weight_bytes / step
        ratio = step / floor.seconds
        print(f"  {path}: one autoregressive step {step * 1e3:.1f} ms = {ratio:.2f}x the floor "
              f"({'within' if ratio <= STEP_GOAL else 'outside'} the {STEP_GOAL}x goal); {read / 1e9:.1f} GB/s of "
              f"weights read, {read / floor.copy_bandwidth:.0%} of memory-copy bandwidth "
              f"{floor.copy_bandwidth / 1e9:.1f} GB/s"
              + (f"; fastest round {fastest[path] * 1e3:.1f} ms = {fastest[path] / floor.seconds:.2f}x"
                 if fastest else ""))


def split_paths(lm, args: argparse.Namespace, choices: list[tuple[str, tuple]], floor: Floor) -> pd.DataFrame:
    """--split: per eager path, forwards of the --split widths (and the autoregressive step) split into
    linears, attention and the rest (decoders/tuning/forward_split.py), printed with what holds each back.
    On the profile's own model, uncompiled, each path put on it in turn."""
    from decoders.tuning.forward_split import matmul_rate, split_forwards, split_table

    lm.set_compile("none")  # before the kernels change, as profile_paths does
    rate = matmul_rate(lm.device, lm.dtype)
    print(f"\nwhere each forward's time goes ({args.context} cached tokens, median of {args.repeats}); the linears "
          f"against the read bandwidth {floor.read_bandwidth / 1e9:.1f} GB/s and a 1536^3 matmul's "
          f"{rate / 1e9:.0f} GFLOP/s:")
    tables = []
    for path, choice in choices:
        if path.endswith("+inductor"):
            print(f"{path}: not split (a compiled forward calls its kernels outside Python)")
            continue
        if not put_on_path(lm, path, choice, Profiles()):
            continue
        table = split_table(split_forwards(lm, [0, *args.split], args.context, args.repeats),
                            floor.read_bandwidth, rate).assign(path=path)
        print(table.drop(columns="path").to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        tables.append(table)
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()


def plot(table: pd.DataFrame, steps: dict[str, float], where: str):
    """Each path's latency relative to the native autoregressive step, by tokens in one forward; `where`:
    the model, device and dtype (plotting.setup)."""
    fig, ax = pyplot().subplots(figsize=(6.5, 4), layout="constrained")
    styles = entry_styles(steps)
    for path, step in steps.items():
        ax.plot(table["tokens"], table[f"{path}_vs_native_step"], ms=4,
                label=f"{path}\n(1-token step {step * 1e3:.1f} ms)", **styles[path])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="new tokens in one forward (tokens)", ylabel="latency / the native path's 1-token step (x)",
           ylim=(0, None))
    title(ax, "Cost of a forward against its width, per fast path", where)
    ax.grid(alpha=0.3)
    legend_beside(ax)
    return fig


def replot(folder: Path) -> Path:
    """profile.png drawn again from the profile.csv and provenance.json (or profile_provenance.json) beside it."""
    table = pd.read_csv(folder / "profile.csv")
    if "context" in table:  # the first context's rows: what the run plotted
        table = table[table["context"] == table["context"].iloc[0]]
    info = next((json.loads(p.read_text()) for p in (folder / "provenance.json", folder / "profile_provenance.json")
                 if p.is_file()), {})
    model = info.get("model") or next(iter(re.findall(r"model(?:\.name)?=(\S+)", info.get("command", ""))[::-1]),
                                      "smollm2-135m")
    steps = info.get("autoregressive_s") or {}
    steps = {p: steps.get(p, float("nan")) for p in (c.removesuffix("_vs_native_step") for c in table.columns
                                                    if c.endswith("_vs_native_step"))}
    return save(plot(table, steps, setup(info, model)), folder / "profile.png", dpi=120)


def provenance_info(lm, args: argparse.Namespace, profiles: Profiles, floor: Floor) -> dict:
    info = provenance.collect(lm)
    info.update(model=lm.name, fast_path="see columns", packed_min_rows="see columns", profiles=profiles.keys,
                autoregressive_s=profiles.steps, weight_bytes=floor.weight_bytes,
                copy_bandwidth_bytes_per_s=floor.copy_bandwidth, read_bandwidth_bytes_per_s=floor.read_bandwidth,
                floor_s=floor.seconds, step_vs_floor={p: s / floor.seconds for p, s in profiles.steps.items()},
                **({"autoregressive_min_s": profiles.fastest_steps} if profiles.fastest_steps else {}),
                compile_seconds=profiles.compile_s, context=args.context, repeats=args.repeats,
                kernel_build_seconds=round(lm.kernel_build_seconds, 1), interleaved_rounds=args.interleave or None,
                statistic=("median of interleaved rounds" if args.interleave
                           else "fastest round, non-decreasing in k on each kernel"),
                **({"contexts": args.contexts} if len(args.contexts) > 1 else {}),
                command=" ".join(["python scripts/profile_device.py", *sys.argv[1:]]))
    return info


def main() -> None:
    args, overrides, choices = parse_args()
    if args.replot:
        print(f"plot: {replot(Path(args.replot))}")
        return
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if args.interleave:
        profiles, lm = profile_interleaved(cfg, args, choices)
    else:
        lm = instantiate(cfg.model, fast_path="none", compile="none").load()
        profiles = profile_paths(lm, cfg.cache_dir, args, choices)
    table = latency_table(profiles, args.max_tokens)
    if profiles.other_contexts:
        blocks = [(args.context, table)] + [(c, latency_table(p, args.max_tokens)) for c, p in
                                            profiles.other_contexts.items()]
        table = pd.concat([t.assign(context=c) for c, t in blocks], ignore_index=True)
        table = table[["context"] + [c for c in table.columns if c != "context"]]
    floor = measure_floor(lm)
    print_steps_against_floor(lm, args, profiles.steps, floor, profiles.fastest_steps)
    for path in profiles.curves:
        table[f"{path}_vs_floor"] = table[f"{path}_ms"] / 1e3 / floor.seconds
    shown = table[table["tokens"].isin([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])]
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    split = split_paths(lm, args, choices, floor) if args.split else None
    fig = plot(table.iloc[:args.max_tokens], profiles.steps, setup_of(lm))  # the first context's rows
    out = Path(args.out) if args.out else Path(cfg.cache_dir).expanduser() / "latency"
    out.mkdir(parents=True, exist_ok=True)
    stem = "profile" if args.out else profile_key(lm, fast_path=False)
    save(fig, out / f"{stem}.png", dpi=120)
    table.to_csv(out / f"{stem}.csv", index=False)
    if args.out:
        (out / "provenance.json").write_text(json.dumps(provenance_info(lm, args, profiles, floor), indent=2))
        if split is not None and len(split):
            split.to_csv(out / "split.csv", index=False)
    print(f"table: {out / f'{stem}.csv'}\nplot: {out / f'{stem}.png'}")


if __name__ == "__main__":
    main()
