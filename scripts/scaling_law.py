"""The lookahead scaling law from W x N sweeps: steps for T tokens vs FLOPs per step, tokens/s vs W.

    python scripts/scaling_law.py SWEEP_DIR... [--out DIR] [--tokens T] [--throughput DIR...]

Writes steps_vs_flops.png, residuals.png, tokens_per_s_vs_window.png, scaling_points.csv,
scaling_fit.csv, local_slopes.csv and scaling_fit.md into --out (default: the first sweep
directory's scaling/), one subdirectory <model>_<dataset> each when the runs hold several, and
prints each fit steps = a - b ln(FLOPs per step) with its b. --throughput: runs (of the same
settings, made on a quiet machine) whose tokens/s are plotted instead of the sweep's. The work
is done by bench.scaling.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from bench import scaling
from bench.usage import Parser


def main(argv: list[str] | None = None) -> None:
    parser = Parser(__doc__, prog="python scripts/scaling_law.py")
    parser.add_argument("paths", nargs="+", metavar="SWEEP_DIR", help="sweep or run directories")
    parser.add_argument("--out", help="output directory (default: SWEEP_DIR/scaling)")
    parser.add_argument("--tokens", type=int, help="T, the tokens to generate (default: the runs' max_new_tokens)")
    parser.add_argument("--throughput", nargs="+", metavar="DIR",
                        help="runs whose tokens/s are plotted against W (default: the sweep's own)")
    args = parser.parse_args(argv)
    if args.tokens is not None and args.tokens < 1:
        parser.error("--tokens must be >= 1")
    try:
        analyses = scaling.analyse_each(args.paths, args.tokens, args.throughput)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out or Path(args.paths[0]) / "scaling")
    for key, analysis in analyses.items():
        written = scaling.write(analysis, out if len(analyses) == 1 else out / key)
        print(f"## {analysis.setup}\n")
        print(analysis.fits.to_markdown(index=False, floatfmt=".4g"))
        fit = analysis.fits.iloc[0]
        print(f"\nsteps for {analysis.tokens} tokens = {fit['a']:.4g} - b ln(FLOPs per step), "
              f"b = {fit['b']:.4g} ({fit['b_per_decade']:.4g} steps per 10x FLOPs, R² = {fit['r2']:.3f}, "
              f"{int(fit['points'])} runs)\n")
        print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)

if __name__ == "__main__":
    main()
