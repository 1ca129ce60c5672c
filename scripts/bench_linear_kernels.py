"""Linear-layer kernels on this CPU for a forward of k rows, over a model-sized set of weights
(so that nothing stays in cache, as in a real forward), relative to the native 1-row pass.

    python scripts/bench_linear_kernels.py [--layers 30] [--out results/reference/fast_path]

The shapes are SmolLM2-135M's (q, k, v, o, gate, up, down of 30 layers). Kernels: native
F.linear; oneDNN prepacked for any k (what model.fast_path=prepacked uses); MKL packed for one
fixed k (what torch.compile's CPU freezing emits for static shapes), in float32 and bfloat16.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
ROWS = (1, 2, 4, 8, 16, 32)


def timed(fn, weights, k: int, dtype, repeats: int) -> float:
    xs = {i: torch.randn(k, i, dtype=dtype) for i in {i for _, i in SHAPES}}
    def one_pass():
        for layer in weights:
            for j, (_, i) in enumerate(SHAPES):
                fn(xs[i], layer, j)
    for _ in range(2):
        one_pass()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write kernels.csv and kernels_provenance.json here")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            weights = [[torch.randn(o, i, dtype=dtype) * 0.02 for o, i in SHAPES] for _ in range(args.layers)]
            packed = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in layer] for layer in weights]
            index = {id(layer): n for n, layer in enumerate(weights)}
            native = lambda x, layer, j: F.linear(x, layer[j])  # noqa: E731
            onednn = lambda x, layer, j: torch.ops.mkldnn._linear_pointwise(  # noqa: E731
                x, packed[index[id(layer)]][j], None, "none", [], "")
            unit = timed(native, weights, 1, dtype, args.repeats)
            name = str(dtype).replace("torch.", "")
            for k in ROWS:
                rows.append({"dtype": name, "kernel": "native", "rows": k,
                             "vs_native_1_row": timed(native, weights, k, dtype, args.repeats) / unit})
                rows.append({"dtype": name, "kernel": "onednn_prepacked", "rows": k,
                             "vs_native_1_row": timed(onednn, weights, k, dtype, args.repeats) / unit})
                if dtype == torch.float32 and k in (2, 8, 16):  # one packed copy per k: measured at a few
                    mkl = [[torch.ops.mkl._mkl_reorder_linear_weight(w, k) for w in layer] for layer in weights]
                    fixed = lambda x, layer, j: torch.ops.mkl._mkl_linear(  # noqa: E731
                        x, mkl[index[id(layer)]][j], layer[j], None, k)
                    rows.append({"dtype": name, "kernel": "mkl_packed_fixed_k", "rows": k,
                                 "vs_native_1_row": timed(fixed, weights, k, dtype, args.repeats) / unit})
                    del mkl
            print(f"{name}: native 1-row pass over "
                  f"{sum(o * i for o, i in SHAPES) * args.layers * dtype.itemsize / 1e6:.0f} MB "
                  f"of weights: {unit * 1e3:.1f} ms", flush=True)
    table = pd.DataFrame(rows).pivot_table(index=["dtype", "kernel"], columns="rows", values="vs_native_1_row")
    print(table.to_string(float_format=lambda v: f"{v:.2f}"))
    if args.out:
        from bench.provenance import git_output
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "kernels.csv")
        import importlib.metadata
        (out / "kernels_provenance.json").write_text(json.dumps({
            "git_commit": git_output("rev-parse", "HEAD"),
            "git_dirty": bool(git_output("status", "--porcelain", "--untracked-files=no")),
            "torch": importlib.metadata.version("torch"), "torch_threads": torch.get_num_threads(),
            "command": " ".join(["python scripts/bench_linear_kernels.py", *sys.argv[1:]])}, indent=2))


if __name__ == "__main__":
    main()
