"""This device's forward cost curves, one per fast path, side by side: the latency of a forward of
k = 1..K new tokens (tree-style: mask and positions, after --context cached tokens) relative to
one autoregressive step, and how close the 1-token step is to its floor: the model's weights read
once at this machine's measured read bandwidth (a read-only stream). A path ending in +inductor
is that path with model.compile=inductor (compiled first; its compile time is printed apart).

    python scripts/profile_device.py [--max-tokens 64] [--repeats 5] [--refresh] [--out DIR] [hydra overrides...]

Profiles are cached under cache_dir/latency/, keyed by device, CPU threads, model, dtype,
attention kernel and fast path: lookahead's `auto` W/N/G, Sequoia's tree=auto and Medusa's
choices=auto divide by the one of the path the run uses. --out writes the table (CSV), the
plot and provenance.json there (results/reference/fast_path/ holds the README's).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import matplotlib
import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import provenance  # noqa: E402
from decoders.tuning.profile import candidate_labels, forward_latency, parse_candidate, profile_key  # noqa: E402

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


STEP_GOAL = 1.3  # issue 32: the 1-token step within 1.3x of its weight-read floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--paths", default=",".join(candidate_labels()),
                        help="fast paths to profile, comma-separated: none, "
                             "prepacked (its default threshold), prepacked>=N; +inductor: compiled too")
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    parser.add_argument("--out", help="also write profile.csv, profile.png and provenance.json here")
    args, overrides = parser.parse_known_args()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    lm = instantiate(cfg.model, fast_path="none", compile="none").load()
    paths = [p for p in args.paths.split(",") if p]
    try:
        choices = {p: parse_candidate(p.removesuffix("+inductor")) for p in paths}
    except ValueError as e:
        parser.error(str(e))
    curves, steps, keys, compile_s = {}, {}, {}, {}
    for path in paths:
        lm.set_compile("none")  # before the kernels change: a graph is traced over them
        if lm.set_fast_path(*choices[path]) != choices[path][0]:
            print(f"{path}: skipped ({lm.fast_path_note})")
            continue
        if path.endswith("+inductor"):
            if lm.set_compile("inductor") != "inductor":
                print(f"{path}: skipped ({lm.compile_note})")
                continue
            compile_s[path] = lm.compile_seconds
            print(f"{path}: compiled in {compile_s[path]:.1f} s (not in any timing)")
        profile = forward_latency(lm, cfg.cache_dir, args.max_tokens, args.context, args.repeats, refresh=args.refresh)
        curves[path] = profile["latency_s"][:args.max_tokens]  # a longer cached profile serves a shorter ask
        steps[path], keys[path] = profile["autoregressive_s"], profile["key"]
    base = steps["none"] if "none" in steps else next(iter(steps.values()))
    table = pd.DataFrame({"tokens": range(1, args.max_tokens + 1)})
    for path, latency in curves.items():
        table[f"{path}_ms"] = [s * 1e3 for s in latency]
        table[f"{path}_vs_own_step"] = [s / steps[path] for s in latency]
        table[f"{path}_vs_native_step"] = [s / base for s in latency]
    weight_bytes = lm.flops_spec()["matmul_params"] * lm.model.get_input_embeddings().weight.element_size()
    bandwidth, reading = copy_bandwidth(lm.device), read_bandwidth(lm.device)
    floor = weight_bytes / reading
    print(f"{lm.name}, {str(lm.dtype).replace('torch.', '')}, {torch.get_num_threads()} threads, "
          f"{args.context} cached tokens, fastest of {args.repeats} rounds per size; "
          f"weights {weight_bytes / 1e6:.0f} MB, read once at {reading / 1e9:.1f} GB/s (read-only stream) "
          f"in {floor * 1e3:.1f} ms: the step's floor")
    for path in curves:
        read = weight_bytes / steps[path]
        ratio = steps[path] / floor
        print(f"  {path}: one autoregressive step {steps[path] * 1e3:.1f} ms = {ratio:.2f}x the floor "
              f"({'within' if ratio <= STEP_GOAL else 'outside'} the {STEP_GOAL}x goal); {read / 1e9:.1f} GB/s of "
              f"weights read, {read / bandwidth:.0%} of memory-copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    for path in curves:
        table[f"{path}_vs_floor"] = [s / floor for s in curves[path]]
    shown = table[table["tokens"].isin([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])]
    print(shown.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for path in curves:
        ax.plot(table["tokens"], table[f"{path}_vs_native_step"], marker=".",
                label=f"{path} (1-token step {steps[path] * 1e3:.1f} ms)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="new tokens in one forward", ylabel="latency / native autoregressive step",
           title=f"{lm.name} {str(lm.dtype).replace('torch.', '')}, {torch.get_num_threads()} threads", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(cfg.cache_dir).expanduser() / "latency"
    out.mkdir(parents=True, exist_ok=True)
    stem = "profile" if args.out else profile_key(lm, fast_path=False)
    fig.savefig(out / f"{stem}.png", dpi=120)
    table.to_csv(out / f"{stem}.csv", index=False)
    if args.out:
        info = provenance.collect(lm)
        info.update(fast_path="see columns", packed_min_rows="see columns", profiles=keys, autoregressive_s=steps,
                    weight_bytes=weight_bytes,
                    copy_bandwidth_bytes_per_s=bandwidth, read_bandwidth_bytes_per_s=reading, floor_s=floor,
                    step_vs_floor={p: steps[p] / floor for p in steps}, compile_seconds=compile_s,
                    context=args.context, repeats=args.repeats,
                    command=" ".join(["python scripts/profile_device.py", *sys.argv[1:]]))
        (out / "provenance.json").write_text(json.dumps(info, indent=2))
    print(f"table: {out / f'{stem}.csv'}\nplot: {out / f'{stem}.png'}")


if __name__ == "__main__":
    main()
