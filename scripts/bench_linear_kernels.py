"""Linear-layer kernels on this CPU for a forward of k rows, over a model-sized set of weights
(so that nothing stays in cache, as in a real forward), relative to the native 1-row pass.

    python scripts/bench_linear_kernels.py [--layers 30] [--rows 1,2,4,8,16,32] [--repeats 7]
        [--variants "-DDB_ROWS=12;-DDB_PREFETCH=0"] [--out results/reference/fast_path]

The shapes are SmolLM2-135M's (q, k, v, o, gate, up, down of 30 layers). Kernels: native
F.linear; oneDNN prepacked for any k (what model.fast_path=prepacked uses); MKL packed for one
fixed k (what torch.compile's CPU freezing emits for static shapes), in float32 only; ours
(model.fast_path=kernel, decoders/core/kernels.py) where this CPU runs it, and --variants of it
(the same source built with other -D knobs: DB_ROWS, DB_PANEL, DB_PREFETCH, DB_KCHUNK) for tuning. Every
repeat passes over every kernel in a rotating order (side by side on a busy machine); each
kernel's median pass is reported (kernels.csv), and its fastest (kernels_fastest.csv).

--forward also times SmolLM2-135M's whole float32 forward on the kernel path (`model.fast_path=kernel`:
its linears, norms and rotary) with each build of ours in turn (kernels.using), in one process,
interleaved: the autoregressive step (tokens 0) and k new tokens after 256 cached, as a tree's
verification feeds them (profile.timed_forward). Median and fastest per build (forward.csv).
"""
from __future__ import annotations

import hashlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from bench.usage import Parser
from decoders.core import kernels
from decoders.core.fast_path import linear_problem

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
ROWS = (1, 2, 4, 8, 16, 32)
MKL_ROWS = (2, 8, 16)  # one packed copy per k: measured at a few


def variant(flags: str, where: Path) -> kernels.Library:
    """The kernel's source built with extra -D flags (g++, the same flags as the extension)."""
    name = hashlib.sha1(flags.encode()).hexdigest()[:8]
    library = where / f"variant_{name}.so"
    subprocess.run(["g++", *kernels.CFLAGS[kernels.isa()], "-shared", "-fPIC", *flags.split(), "-o", str(library),
                    str(kernels.SOURCE)], check=True)
    return kernels.Library(library)


def kernel_table(dtype, layers: int, libraries: dict[str, kernels.Library]) -> dict:
    """name -> (prepare(k) -> one pass over every layer for inputs of k rows), for `dtype`."""
    weights = [[torch.randn(o, i, dtype=dtype) * 0.02 for o, i in SHAPES] for _ in range(layers)]
    flat = [w for layer in weights for w in layer]
    table = {}

    def inputs(k):
        return [torch.randn(k, w.shape[1], dtype=dtype) for w in flat]

    def native(k):
        xs = inputs(k)
        return lambda: [F.linear(x, w) for x, w in zip(xs, flat)]

    table["native"] = native
    why_not = linear_problem(dtype)
    if why_not:  # e.g. bfloat16 on a CPU without AVX-512 (a Zen 3)
        print(f"{str(dtype).replace('torch.', '')}: onednn_prepacked skipped ({why_not})")
    else:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in flat]

        def packed(k):
            xs = inputs(k)
            return lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, onednn)]
        table["onednn_prepacked"] = packed
    if dtype == torch.float32:
        def mkl(k):
            if k not in MKL_ROWS:
                return None
            xs, fixed = inputs(k), [torch.ops.mkl._mkl_reorder_linear_weight(w, k) for w in flat]
            return lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, k) for x, p, w in zip(xs, fixed, flat)]
        table["mkl_packed_fixed_k"] = mkl
    for label, lib in libraries.items():
        ours = [lib.pack(w) for w in flat]

        def kernel(k, lib=lib, ours=ours):
            xs = inputs(k)
            return lambda: [lib.linear(x, p, None, w.shape[0]) for x, p, w in zip(xs, ours, flat)]
        table[label] = kernel
    return table


def rotated(labels: list[str], r: int) -> list[str]:
    """Round r's order: each label leads in turn, so no kernel always runs first (side by side on a busy machine)."""
    return labels[r % len(labels):] + labels[:r % len(labels)]


def smollm2_on_kernels():
    """SmolLM2-135M in float32 on model.fast_path=kernel, as the default config loads it."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from bench.registry import CONF_DIR
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["dtype=float32", "device=cpu"])
    return instantiate(cfg.model, fast_path="kernel", compile="none").load()


def forward_table(lm, libraries: dict[str, kernels.Library], rows: list[int], repeats: int,
                  context: int = 256) -> pd.DataFrame:
    """lm's forward of 0 (the step) and each of `rows` new tokens after `context` cached, per build, interleaved."""
    from decoders.tuning.profile import primed_cache, timed_forward
    sizes = [0, *rows]
    ids, cache = primed_cache(lm, context, max(rows), random.Random(0))
    seconds: dict[tuple[str, int], list[float]] = {}
    labels = list(libraries)
    for r in range(repeats + 1):  # the first round warms up
        for label in rotated(labels, r):
            with kernels.using(libraries[label]):
                for k in random.Random(r).sample(sizes, len(sizes)):
                    elapsed = timed_forward(lm, ids, cache, context, k)
                    if r:
                        seconds.setdefault((label, k), []).append(elapsed)
    rows_out = []
    for label in labels:
        step = statistics.median(seconds[(label, 0)])
        for k in sizes:
            s = seconds[(label, k)]
            rows_out.append({"kernel": label, "tokens": k, "ms": statistics.median(s) * 1e3,
                             "fastest_ms": min(s) * 1e3, "vs_own_step": statistics.median(s) / step})
    return pd.DataFrame(rows_out)


def main() -> None:
    parser = Parser(__doc__, prog="python scripts/bench_linear_kernels.py")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default="", help="';'-separated -D flag sets of kernels.cpp to build beside")
    parser.add_argument("--forward", action="store_true", help="also time SmolLM2's whole forward with each build")
    parser.add_argument("--out", help="write kernels.csv and kernels_provenance.json here")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    results, forward = [], None
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            why_not = kernels.dtype_supported(dtype)
            libraries = {} if why_not else {"kernel": kernels.extension()}
            if why_not:
                print(f"{name}: kernel skipped ({why_not})")
            for flags in filter(None, (v.strip() for v in args.variants.split(";"))):
                if not why_not:
                    libraries[f"kernel[{flags}]"] = variant(flags, Path(tmp))
            table = kernel_table(dtype, args.layers, libraries)
            seconds: dict[tuple[str, int], list[float]] = {}
            for k in rows:
                passes = {label: prepare(k) for label, prepare in table.items()}
                passes = {label: run for label, run in passes.items() if run is not None}
                for run in passes.values():
                    run()  # warm-up
                labels = list(passes)
                for r in range(args.repeats):
                    for label in rotated(labels, r):
                        start = time.perf_counter()
                        passes[label]()
                        seconds.setdefault((label, k), []).append(time.perf_counter() - start)
                del passes
            if args.forward and dtype == torch.float32 and libraries:
                forward = forward_table(smollm2_on_kernels(), libraries, rows, args.repeats)
            unit = statistics.median(seconds[("native", rows[0])])
            megabytes = sum(o * i for o, i in SHAPES) * args.layers * dtype.itemsize / 1e6
            print(f"{name}: native {rows[0]}-row pass over {megabytes:.0f} MB of weights: {unit * 1e3:.1f} ms "
                  f"(median of {args.repeats}, interleaved)", flush=True)
            for (label, k), s in seconds.items():
                results.append({"dtype": name, "kernel": label, "rows": k, "ms": statistics.median(s) * 1e3,
                                "fastest_ms": min(s) * 1e3, "vs_native_1_row": statistics.median(s) / unit,
                                "fastest_vs_native_1_row": min(s) / min(seconds[("native", rows[0])])})
    frame = pd.DataFrame(results)
    table = frame.pivot_table(index=["dtype", "kernel"], columns="rows", values="vs_native_1_row", sort=False)
    print(table.to_string(float_format=lambda v: f"{v:.2f}"))
    fastest = frame.pivot_table(index=["dtype", "kernel"], columns="rows", values="fastest_vs_native_1_row", sort=False)
    print("fastest pass of each, relative to native's fastest 1-row pass (less sensitive to other load):")
    print(fastest.to_string(float_format=lambda v: f"{v:.2f}"))
    if forward is not None:
        print("SmolLM2's float32 forward, each build of ours (tokens 0: the step; ms median and fastest, vs own step):")
        print(forward.pivot_table(index="kernel", columns="tokens", values=["ms", "vs_own_step"], sort=False)
              .to_string(float_format=lambda v: f"{v:.2f}"))
    if args.out:
        from bench.provenance import git_output
        from decoders.tuning.profile import device_name
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "kernels.csv")
        fastest.to_csv(out / "kernels_fastest.csv")
        if forward is not None:
            forward.to_csv(out / "forward.csv", index=False)
        import importlib.metadata
        (out / "kernels_provenance.json").write_text(json.dumps({
            "git_commit": git_output("rev-parse", "HEAD"),
            "git_dirty": bool(git_output("status", "--porcelain", "--untracked-files=no")),
            "torch": importlib.metadata.version("torch"), "torch_threads": torch.get_num_threads(),
            "device_name": device_name(torch.device("cpu")), "statistic": "median of interleaved passes",
            "ms": {f"{r['dtype']}/{r['kernel']}/{r['rows']}": round(r["ms"], 3) for r in results},
            "fastest_ms": {f"{r['dtype']}/{r['kernel']}/{r['rows']}": round(r["fastest_ms"], 3) for r in results},
            "command": " ".join(["python scripts/bench_linear_kernels.py", *sys.argv[1:]])}, indent=2))


if __name__ == "__main__":
    main()
