"""llama.cpp's own speculative examples (llama-lookahead, llama-lookup) on the harness's prompts, beside our
methods on the same engine: their tokens/s as they print it, and whether their output is the engine's greedy one.

    python scripts/llamacpp_examples.py --bin DIR --out DIR [--tokens 128] [hydra overrides: model=, dataset=, ...]

--bin: where a llama.cpp build of the vendored source put llama-lookahead, llama-lookup and llama-cli's peers (the
same llama.cpp llama-cpp-python builds: docs/llamacpp.md says how). Each prompt is rendered as
the harness renders it and given as text; the model is the GGUF as shipped (dtype=auto) or its F32 copy
(dtype=float32), as model.backend=llamacpp reads it. Greedy (--temp 0). Writes examples.csv: per example and prompt
its decoded tokens/s as it prints it (after the prompt), accepted tokens, whether it read the prompt as our tokens
and whether its text agrees with our llama.cpp autoregressive output's; and per prompt that autoregressive run's
own tokens/s after the prompt, the examples' baseline.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from bench.__main__ import script_args

from bench.prompts import prepare, rendering_for
from bench.registry import CONF_DIR
from bench.usage import Parser
from bench.runner import build
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode

SPEED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
ACCEPT = re.compile(r"n_accept\s+=\s+(\d+)")
ENCODED = re.compile(r"encoded\s+(\d+) tokens")


def run_example(binary: Path, gguf: Path, text: str, tokens: int, threads: int) -> dict:
    """One example on one prompt. The text goes in argv with escapes off: a prompt file would lose its final
    newline (llama.cpp's -f drops it) and escapes would rewrite backslashes, so the tokens would not be ours."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", text, "--no-escape", "-n", str(tokens),
                          "-t", str(threads), "--temp", "0", "-c", "4096"], capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    speed, accept, encoded = SPEED.search(log), ACCEPT.search(log), ENCODED.search(log)
    decoded, seconds, rate = (float(g) for g in speed.groups()) if speed else (None, None, None)
    start = out.stdout.find(text)
    return {"returncode": out.returncode, "prompt_tokens": int(encoded.group(1)) if encoded else None,
            "decoded": decoded, "seconds": seconds, "tokens_per_s": rate,
            "n_accept": int(accept.group(1)) if accept else None,
            "continuation": out.stdout[start + len(text):] if start >= 0 else None}


def same_start(ours: str, theirs: str | None) -> bool:
    """Whether two greedy continuations agree as far as both go (the examples stop a token or two apart)."""
    if theirs is None:
        return False
    a, b = ours.strip(), theirs.strip()
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def main(argv=None):
    parser = Parser(__doc__, prog="python scripts/llamacpp_examples.py", overrides=True)
    parser.add_argument("--bin", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tokens", type=int, default=128)
    args, overrides = script_args(parser, argv)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "model.backend=llamacpp"])
    threads = cfg.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    lm = build(cfg.model, "model").load()
    rendering = rendering_for(lm.tokenizer, cfg.prompt_format)
    rows = []
    for prompt in build(cfg.dataset, "dataset").load():
        text, ids, unfit = prepare(lm.tokenizer, prompt, 0, [], rendering, lm.max_context)
        if unfit:
            continue
        greedy = autoregressive_decode(lm, ids, args.tokens, Sampling(), lm.stop_ids)
        ours = lm.tokenizer.decode(greedy.tokens, skip_special_tokens=True)
        decoding = sum(s.target_time + s.draft_time + s.overhead_time for s in greedy.steps[1:])  # after the prompt's
        rows.append({"prompt": prompt.id, "example": "ours: autoregressive", "prompt_tokens": len(ids),
                     "decoded": len(greedy.tokens) - 1, "seconds": decoding,
                     "tokens_per_s": (len(greedy.tokens) - 1) / decoding})
        for example in ("llama-lookahead", "llama-lookup"):
            result = run_example(args.bin / example, lm.gguf, text, args.tokens, threads)
            result["same_as_greedy"] = same_start(ours, result.pop("continuation"))
            result["same_prompt_tokens"] = result["prompt_tokens"] == len(ids)
            rows.append({"prompt": prompt.id, "example": example, **result})
            print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(args.out / "examples.csv", index=False)


if __name__ == "__main__":
    main()
