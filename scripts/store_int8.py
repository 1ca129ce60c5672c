"""Store an add-on of ours (Medusa heads, an EAGLE draft, an exit adapter, or the directory of an EAGLE-3
draft trained here) with its weight matrices in int8, one float16 scale per row (decoders/core/
weights_file.py, int8_state): about half the bytes of the float16 file. Loaders read either. An add-on
ships so only where its acceptance measured the same (adapters/README.md says which, and how).

    python scripts/store_int8.py IN.safetensors --out OUT.safetensors
    python scripts/store_int8.py IN_DIR --out OUT_DIR      # config.json + model.safetensors (EAGLE-3)
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from bench.usage import Parser
from decoders.core.weights_file import INT8, dequantized, save_state


def main(argv: list[str] | None = None) -> None:
    parser = Parser(__doc__, prog="python scripts/store_int8.py")
    parser.add_argument("source", type=Path, help="an add-on file written by this harness (float16), or a directory")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from safetensors import safe_open

    if args.out.resolve() == args.source.resolve():
        sys.exit("error: --out must differ from the source: keep the float16 file to compare against")
    source, out = args.source, args.out
    if source.is_dir():  # the authors' EAGLE-3 layout: the other files as they are
        out.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy2(f, out / f.name)
        source, out = source / "model.safetensors", out / "model.safetensors"
    try:
        with safe_open(str(source), "pt") as f:
            meta = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a missing, damaged or foreign file
        sys.exit(f"error: {source} is not a readable safetensors file ({' '.join(str(e).split())[:200]})")
    if "format" not in meta:
        sys.exit(f"error: {source} is not an add-on file of this harness (no format in its metadata)")
    if INT8 in meta:
        sys.exit(f"error: {source} already stores its matrices in int8")
    fmt = meta.pop("format")
    save_state(state, out, fmt, meta, int8=True)
    with safe_open(str(out), "pt") as f:  # read back as the loaders read it
        back_meta = f.metadata()
        back = dequantized(back_meta, {k: f.get_tensor(k) for k in f.keys()}, "--out", out)
    quantized = json.loads(back_meta[INT8])
    worst = max((float(((back[n] - state[n].float()).abs().amax(1) / state[n].float().abs().amax(1).clamp(min=1e-12))
                       .max()) for n in quantized), default=0.0)
    print(f"{args.out}: {len(quantized)} matrices in int8; {source.stat().st_size} -> {out.stat().st_size} "
          f"bytes; largest error {worst:.4f} of a row's largest value")


if __name__ == "__main__":
    main()
