"""The one-token float32 step on torch (the kernel path) and on llama.cpp (the F32 copy of the same GGUF), in one
process, rounds interleaved: torch's step split into linears, attention and the rest (decoders/tuning/forward_split),
llama.cpp's whole step, and the weights' read floor (every linear weight read once at the measured read bandwidth).
Also torch's step on a narrow twin (the same layers, layer types and heads at width 64, head 16, vocabulary 1024,
random weights): what the same sequence of operations costs when no weight stream sits between them.

    python results/reference/llamacpp/step_split/measure.py --rounds 9 --out DIR model=<config> threads=2
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench import provenance  # noqa: E402
from bench.__main__ import script_args  # noqa: E402
from bench.registry import CONF_DIR  # noqa: E402
from bench.runner import build  # noqa: E402
from bench.usage import Parser  # noqa: E402
from decoders.core.lm import LM  # noqa: E402
from decoders.tuning.forward_split import linear_work, split_forwards  # noqa: E402
from decoders.tuning.profile import forward_samples  # noqa: E402
from profile_device import read_bandwidth  # noqa: E402


def main(argv=None):
    parser = Parser(__doc__, prog="measure.py", overrides=True)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--out", required=True, type=Path)
    args, overrides = script_args(parser, argv)

    def load(backend: str):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, f"model.backend={backend}", "dtype=float32"])
        torch.set_num_threads(cfg.threads or torch.get_num_threads())
        return build(cfg.model, "model").load()

    ours, theirs = load("torch"), load("llamacpp")
    config = copy.deepcopy(ours.model.config)
    config.update({"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "vocab_size": 1024})
    narrow = LM(AutoModelForCausalLM.from_config(config).eval(), name="narrow twin", fast_path=ours.fast_path)
    rows = []
    for i in range(args.rounds):  # each round: both engines, the order alternating
        for engine in (("torch", "llamacpp") if i % 2 == 0 else ("llamacpp", "torch")):
            if engine == "torch":
                for name, lm in (("torch", ours), ("torch narrow twin", narrow)):
                    s = split_forwards(lm, [0], args.context, repeats=3, seed=i)[0]
                    rows.append({"round": i, "engine": name, "step_ms": s.total_s * 1e3,
                                 "linears_ms": s.linear_s * 1e3, "attention_ms": s.attention_s * 1e3,
                                 "rest_ms": s.rest_s * 1e3})
            else:
                step = statistics.median(forward_samples(theirs, 1, args.context, 3, seed=i, sizes=[])[0])
                rows.append({"round": i, "engine": "llamacpp-f32", "step_ms": step * 1e3})
        rows.append({"round": i, "engine": "memory", "read_GBps": read_bandwidth(torch.device("cpu")) / 1e9})
        print(rows[-4:], flush=True)
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "rounds.csv", index=False)
    n_bytes = linear_work(ours.model, 1)[0]
    med = table.groupby("engine").median(numeric_only=True).drop(columns="round")
    gbps = med.loc["memory", "read_GBps"]
    summary = {"model": ours.name, "context": args.context, "rounds": args.rounds, "linear_weight_bytes": n_bytes,
               "read_bandwidth_GBps": gbps, "floor_ms": n_bytes / gbps / 1e6,
               **{f"torch_{k}": med.loc["torch", k] for k in ("step_ms", "linears_ms", "attention_ms", "rest_ms")},
               "llamacpp_f32_step_ms": med.loc["llamacpp-f32", "step_ms"],
               **{f"narrow_twin_{k}": med.loc["torch narrow twin", k]
                  for k in ("step_ms", "linears_ms", "attention_ms", "rest_ms")}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    (args.out / "provenance.json").write_text(json.dumps(provenance.collect(ours), indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
