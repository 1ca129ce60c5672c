"""Every method on every engine, side by side in one process: torch fp32, llama.cpp F32 and llama.cpp at the GGUF's
shipped quantization, each prompt run by every (engine, method) in a rotating order, so that a shared machine's
drift falls on all of them alike.

    python scripts/engines_side_by_side.py --out DIR [--engines torch,llamacpp-f32,llamacpp]
        [--methods autoregressive,prompt_lookup,...] [--curve 1,2,...,32] [--llamacpp-draft smollm2-135m]
        [hydra overrides: model=, dataset=, ...]

DIR gets, per engine, a directory of runs as the leaderboard writes them (DIR/<engine>/<method>/records.jsonl, and
provenance.json in DIR/<engine>): `python -m bench.forecast DIR/<engine> --profile DIR/profiles/<engine>` replays
them at another engine's prices. DIR/profiles/<engine>/profile.csv is that engine's k-token cost curve (a forward of
k tokens after --context cached ones, tree-style, scripts/profile_device.py's layout; by default the context the
runs' middle steps see, as llama.cpp's forwards cost more with more context); DIR/table.csv and table.md the
results: tokens per step, tok/s, speedup over the same engine's autoregressive with its 95% interval, the draft a
draft method ran, and the lossless check (greedy equality with the engine's own one-token decoding; ties proven by
a second computation).
A method whose needs an engine does not give (contract.check_engine) is left out of that engine, with why.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from bench.__main__ import script_args

from bench import metrics, provenance
from bench.errors import BenchError
from bench.prompts import prepare, rendering_for
from bench.registry import CONF_DIR
from bench.usage import Parser
from bench.runner import (RunContext, build, check_config, check_finite_logits, load_addons, prepare_decoder,
                          run_unit, sampling_from, warmup)
from decoders.tuning.profile import forward_samples

ENGINES = {"torch": ["model.backend=torch", "dtype=float32"],
           "llamacpp-f32": ["model.backend=llamacpp", "dtype=float32"],
           "llamacpp": ["model.backend=llamacpp", "dtype=auto"]}
TIE_COUNTS = ("ties_in_wider_dtype", "ties_by_second_computation")
METHODS = ["autoregressive", "prompt_lookup", "suffix", "lookahead", "jacobi", "recycling"]


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def curve(lm, sizes: list[int], context: int, repeats: int) -> pd.DataFrame:
    """ms of a forward of k tokens after `context` cached ones (each size's fastest round), and per k its cost in
    one-token steps (the autoregressive step: one token, causal)."""
    samples = forward_samples(lm, max(sizes), context, repeats, sizes=sizes)
    step = min(samples[0]) * 1e3
    rows = [{"tokens": k, f"{lm.fast_path}_ms": min(samples[k]) * 1e3,
             f"{lm.fast_path}_vs_own_step": min(samples[k]) * 1e3 / step} for k in sizes]
    return pd.DataFrame(rows)


def runs_context(ctx: RunContext, prompts) -> int:
    """The context a run's middle step sees: the median prompt's tokens plus half of the new tokens."""
    lengths = [len(prepare(ctx.lm.tokenizer, p, 0, [], ctx.rendering, ctx.lm.max_context)[1] or []) for p in prompts]
    return int(statistics.median(lengths)) + ctx.cfg.gen.max_new_tokens // 2


def main(argv=None):
    parser = Parser(__doc__, prog="python scripts/engines_side_by_side.py", overrides=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--curve", default=",".join(map(str, range(1, 33))),
                        help="k-token forwards profiled per engine (default every width 1-32: a quantized llama.cpp "
                             "kernel computes rows in tiles, so a width between two others may cost more than both)")
    parser.add_argument("--context", default="auto",
                        help="cached tokens before each profiled forward; auto: where the runs' steps sit (the median "
                             "prompt's tokens + half of gen.max_new_tokens), since llama.cpp's forwards grow with it")
    parser.add_argument("--curve-repeats", type=int, default=5)
    parser.add_argument("--summarize", action="store_true",
                        help="only write the table from the records already in --out (an interrupted run's)")
    parser.add_argument("--llamacpp-draft", default=None,
                        help="draft=<this model config> at its shipped quantization for the draft methods on llama.cpp "
                             "(on torch they keep the run's draft, draft=self by default)")
    args, overrides = script_args(parser, argv)
    if args.context != "auto" and not args.context.isdigit():
        parser.error(f"--context {args.context}: give a number of cached tokens, or auto")
    if args.summarize:
        return write(args.out, {(d.parent.name, d.name): [json.loads(line) for line in open(d / "records.jsonl")]
                                for d in sorted(args.out.glob("*/*")) if (d / "records.jsonl").is_file()}, [])
    engines, methods = args.engines.split(","), args.methods.split(",")
    if methods[0] != "autoregressive":
        methods = ["autoregressive", *[m for m in methods if m != "autoregressive"]]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: {', '.join(unknown)} not among {', '.join(ENGINES)}")
    base = composed(overrides + ["check_lossless=true"])
    if base.threads:
        torch.set_num_threads(base.threads)
    dataset = build(base.dataset, "dataset")
    prompts = dataset.load()
    ctxs, skipped, drafts = {}, [], {}
    named_draft = next((o.split("=", 1)[1] for o in overrides if o.startswith("draft=")), "self")  # the run's draft
    for engine in engines:
        on_llamacpp = args.llamacpp_draft and engine != "torch"
        draft = [f"draft={args.llamacpp_draft}", "draft.dtype=auto"] if on_llamacpp else []
        cfgs = {m: composed([*overrides, "check_lossless=true", f"decoder={m}", *ENGINES[engine], *draft])
                for m in methods}
        decoders = {}
        for m, cfg in cfgs.items():
            try:
                decoders[m] = check_config(cfg)[1]
            except BenchError as e:
                skipped.append({"engine": engine, "method": m, "why": str(e)})
        widest = max(getattr(d, "widest_step", 1) for d in decoders.values())
        lm = build(cfgs["autoregressive"].model, "model").load(step=widest)
        check_finite_logits(lm)
        for m, decoder in decoders.items():
            load_addons(decoder, lm)
            ctx = RunContext(lm, decoder, dataset, rendering_for(lm.tokenizer, cfgs[m].prompt_format), cfgs[m],
                             sampling_from(cfgs[m]))
            prepare_decoder(ctx, prompts)
            warmup(ctx, [(prompts[0], 0)])
            ctxs[engine, m] = ctx
            if "draft" in cfgs[m].decoder:  # which draft each entry ran, in its records and the table
                drafts[engine, m] = (f"{args.llamacpp_draft} (GGUF as shipped)" if on_llamacpp else
                                     f"self ({cfgs[m].draft.layers} layers)" if named_draft == "self" else named_draft)
        profile = args.out / "profiles" / engine
        profile.mkdir(parents=True, exist_ok=True)
        context = int(args.context) if args.context != "auto" else runs_context(ctxs[engine, "autoregressive"], prompts)
        print(f"[side-by-side] {engine}: the k-token curve after {context} cached tokens", flush=True)
        curve(lm, [int(k) for k in args.curve.split(",")], context, args.curve_repeats).to_csv(
            profile / "profile.csv", index=False)
        info = provenance.collect(lm)
        (profile / "provenance.json").write_text(json.dumps({**info, "context_tokens": context}, indent=2))
        (args.out / engine).mkdir(parents=True, exist_ok=True)
        (args.out / engine / "provenance.json").write_text(json.dumps(info, indent=2))
    records: dict[tuple, list[dict]] = {key: [] for key in ctxs}
    order = list(ctxs)
    for key in order:
        (args.out / key[0] / key[1]).mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(prompts):
        for key in order[i % len(order):] + order[:i % len(order)]:  # rotated: no entry always runs first
            with torch.inference_mode():
                record = run_unit(ctxs[key], prompt, 0, [])
            if key in drafts:
                record["draft"] = drafts[key]
            records[key].append(record)
            with open(args.out / key[0] / key[1] / "records.jsonl", "a") as f:  # kept as it goes
                f.write(json.dumps(records[key][-1]) + "\n")
            print(f"[side-by-side] {prompt.id} {key[0]} {key[1]}: {records[key][-1].get('tokens_per_s', 0):.1f} tok/s",
                  flush=True)
    write(args.out, records, skipped)


def write(out: Path, records: dict[tuple, list[dict]], skipped: list[dict]) -> None:
    rows = []
    for (engine, method), recs in records.items():
        ok = [r for r in recs if r["status"] == "ok"]
        ref = {r["prompt_id"]: r for r in records.get((engine, "autoregressive"), []) if r["status"] == "ok"}
        pairs = [(r, ref[r["prompt_id"]]) for r in ok if r["prompt_id"] in ref]
        rows.append({"engine": engine, "method": method, "draft": next((r["draft"] for r in ok if "draft" in r), ""),
                     "prompts": len(ok),
                     "tokens_per_step": metrics.tokens_per_step(ok), "tokens_per_s": metrics.mean_tokens_per_s(ok),
                     **metrics.speedups(pairs), **metrics.speedup_interval(pairs), **metrics.lossless_columns(ok),
                     **{k: sum(r.get(k) or 0 for r in ok) for k in TIE_COUNTS}})
    table = pd.DataFrame(rows)
    table.to_csv(out / "table.csv", index=False)
    (out / "table.md").write_text(table.to_markdown(index=False, floatfmt=".3g") + "\n" + "".join(
        f"\n- {s['engine']} / {s['method']}: {s['why']}" for s in skipped) + "\n")
    print(table.to_markdown(index=False, floatfmt=".3g"))


if __name__ == "__main__":
    main()
