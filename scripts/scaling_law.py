"""The lookahead scaling law from W x N sweeps: steps for T tokens vs FLOPs per step, tokens/s vs W.

    python scripts/scaling_law.py SWEEP_DIR... [--out DIR] [--tokens T]

Writes steps_vs_flops.png, tokens_per_s_vs_window.png, scaling_points.csv, scaling_fit.csv and
scaling_fit.md into --out (default: the first sweep directory's scaling/), and prints the fit
steps = a - b ln(FLOPs per step) with its b. The work is done by bench.scaling.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import scaling  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="SWEEP_DIR", help="sweep or run directories")
    parser.add_argument("--out", help="output directory (default: SWEEP_DIR/scaling)")
    parser.add_argument("--tokens", type=int, help="T, the tokens to generate (default: the runs' max_new_tokens)")
    args = parser.parse_args(argv)
    if args.tokens is not None and args.tokens < 1:
        parser.error("--tokens must be >= 1")
    try:
        analysis = scaling.analyse(args.paths, args.tokens)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out or Path(args.paths[0]) / "scaling")
    written = scaling.write(analysis, out)
    print(analysis.fits.to_markdown(index=False, floatfmt=".4g"))
    fit = analysis.fits.iloc[0]
    print(f"\nsteps for {analysis.tokens} tokens = {fit['a']:.4g} - b ln(FLOPs per step), "
          f"b = {fit['b']:.4g} ({fit['b_per_decade']:.4g} steps per 10x FLOPs, R² = {fit['r2']:.3f}, "
          f"{int(fit['points'])} runs)")
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)


if __name__ == "__main__":
    main()
