"""Store an add-on file of ours (Medusa heads, an EAGLE draft, an exit adapter) with its weight matrices
in int8, one float16 scale per row (decoders/core/weights_file.py, int8_state): half the bytes of the
float16 file. Loaders read either. An add-on ships so only where its acceptance measured the same
(adapters/README.md says which, and how it was measured).

    python scripts/store_int8.py IN.safetensors --out OUT.safetensors
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decoders.core.weights_file import INT8, load_weights, save_state  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="an add-on file written by this harness (float16)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from safetensors import safe_open

    try:
        with safe_open(str(args.source), "pt") as f:
            meta = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a missing, damaged or foreign file
        sys.exit(f"error: {args.source} is not a readable safetensors file ({' '.join(str(e).split())[:200]})")
    if "format" not in meta:
        sys.exit(f"error: {args.source} is not an add-on file of this harness (no format in its metadata)")
    if INT8 in meta:
        sys.exit(f"error: {args.source} already stores its matrices in int8")
    if args.out.resolve() == args.source.resolve():
        sys.exit("error: --out must differ from the source: keep the float16 file to compare against")
    fmt = meta.pop("format")
    save_state(state, args.out, fmt, meta, int8=True)
    back_meta, back = load_weights(args.out, fmt, "--out", "add-on file", "")  # as the loaders read it
    quantized = json.loads(back_meta[INT8])
    worst = max((float(((back[n] - state[n].float()).abs().amax(1) / state[n].float().abs().amax(1).clamp(min=1e-12))
                       .max()) for n in quantized), default=0.0)
    print(f"{args.out}: {len(quantized)} matrices in int8; {args.source.stat().st_size} -> {args.out.stat().st_size} "
          f"bytes; largest error {worst:.4f} of a row's largest value")


if __name__ == "__main__":
    main()
