"""`python -m bench.leaderboard [+preset=NAME] [overrides]`: every decoder on the same prompts of
every dataset, side by side, into one Spec-Bench-style table (conf/leaderboard.yaml).

Per dataset the model is loaded once and every decoder built once; each prompt is then run by
every decoder in a rotating order (no method always runs first), `leaderboard.repeats` times
(default 1), so ratios compare runs made in the same process under the same conditions. Each
(dataset, decoder) is an ordinary run directory (out_dir/<dataset>/<label>/: config.yaml,
records.jsonl, summary.csv), so `python -m bench.show` and `python -m bench.report` read them,
and a rerun with the same out_dir resumes: finished records are skipped, none is duplicated.

Presets (conf/preset/<name>.yaml, `+preset=<name>`) are focused comparisons: each adds its
labelled entries to leaderboard.decoders, selects them with leaderboard.only (autoregressive,
the reference, always among them) and sets datasets, limit (4), repeats and out_dir:
- speculative: spec_chain-8, specinfer-2x4, sequoia-8 (the same 8 draft nodes per step),
  sequoia-auto and hf_assisted, all with the same draft (the `draft` group),
- lookahead: lookahead (N,W,G = 4,5,5), lookahead-w15n7, lookahead-auto, jacobi, hf_pld (2 repeats),
- heads: medusa-auto-32/-64, medusa-chain, bpd-p1/-p4 and their n-gram rescored bpd-ngram-p1/-p4
  (bpd-neural-p4 is defined; add it to leaderboard.only),
- baselines: autoregressive against transformers' generate() (3 repeats; decode_overhead_frac),
- spec_bench: Spec-Bench's protocol (its 480 questions, every turn, 1024 tokens, 3 repeats) with
  each target's published drafts (${model.drafts.<kind>} in an entry: the model config's draft).
A preset writes results/<preset>/ (not under version control). The checked-in tables the README
quotes live in results/reference/<topic>/ and are remade from a clean tree with
leaderboard.out_dir=results/reference/<topic>: a preset never writes there by default, since a
rerun into an existing out_dir resumes and would add records of another commit to a reference.

The table (out_dir/leaderboard.csv, .md), per decoder and dataset and overall:
- runs: timed runs (prompts x leaderboard.repeats),
- tokens_per_step: new tokens / target forward passes, prefill included,
- mean_accepted_tokens: Spec-Bench's (prefill excluded, bonus token included),
- tokens_per_s: new tokens / seconds, summed over timed runs,
- speedup (Spec-Bench's), speedup_geomean, speedup_pooled: bench/metrics.py defines them, over
  every timed run, each repeat against the reference's same repeat,
- speedup_per_run_median / _p25 / _p75: the spread of the per-run ratio (bench/metrics.py),
- decode_overhead_frac: share of decoding-step time outside the target and draft forwards,
- acceptance_rate: accepted / proposed draft tokens,
- flops_per_token_vs_ar: (target + draft FLOPs) per token, relative to autoregressive's,
- same_as_autoregressive: the share of prompts whose output equals the autoregressive entry's token
  for token (bench/metrics.py, same_output_share); under sampling equal outputs need equal random
  streams, so it is then no test of losslessness,
- lossless, lossless_up_to_ties, real_divergences (greedy only): the lossless check of bench/metrics.py
  (judge_output, lossless_columns), each output judged against the autoregressive entry's on the same
  prompt, untimed, after the prompt's timed runs: a departure at a tie (within metrics.TIE_ULPS of the
  target's top-1 on the output's own path) is no loss. A later turn whose prompt differs from
  autoregressive's (it renders the method's own earlier answers) is not judged; with check_lossless=true
  every record is judged against its own autoregressive run instead,
- quality: the dataset's metric (HumanEval pass@1, GSM8K accuracy; MT-Bench has none).
Every figure is computed by bench/metrics.py. The leaderboard times one prompt at a time:
gen.batch_size must be 1.
Where prompts carry a category (MT-Bench, Spec-Bench), leaderboard_by_category.csv/.md break it down
and spec_bench.csv/.md give the speedup (mean ± std over repeats) and mean accepted tokens in
Spec-Bench's layout, a column per task group plus Overall (bench/spec_bench_table.py);
leaderboard.turns=all runs every turn of a conversation (default: the first);
tuning.csv sets each auto-tuner's forecast beside what it measured. provenance.json (commit,
clean tree, versions, device, threads, dtype, fast path, and the command line's overrides) and
leaderboard.yaml (the composed config) say what the table was made from. Where an output departs
from autoregressive's, scripts/divergence_gaps.py OUT_DIR measures how close the call was.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from decoders.core.contract import carried_copy, carry, widest_step
from decoders.core.weights_file import addon_bytes

from . import registry, rundir, spec_bench_table
from .__main__ import CONF_DIR, GROUPS, check_devices, check_writable, config_choices, error_reason
from .errors import BenchError
from .leaderboard_tables import (CATEGORY_COLUMNS, LOSSLESS_COLUMNS, category_table, markdown, table, tuning_table,
                                 write_summaries)
from .prompts import encode, rendering_for
from .records import RecordLog
from .registry import REFERENCE
from .settings import check_seed
from .runner import (Pace, RunContext, build, check_config, judge_lossless, load_addons,
                     prepare_decoder, record_settings, run_unit, sampling_from, skipped_turn, warmup)

TURNS = ("first", "all")  # leaderboard.turns: a conversation's first turn only, or every turn (Spec-Bench's)


def compose_all(overrides: list[str]):
    """The leaderboard config, and per (dataset, label) the full run config."""
    precheck(overrides)
    methods = registry.store_leaderboard_entries(registry.searchpath_dirs(overrides))  # each method's default entry
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            base = compose("leaderboard", overrides=overrides)
        except Exception as e:  # an unknown key, a bad value: Hydra's reason, in one line
            raise BenchError(f"{' '.join(overrides)}: {error_reason(e)}") from None
        check_seed(base.seed)
        check_devices(base)
        batch_size = base.gen.get("batch_size", 1)
        if batch_size != 1:
            raise BenchError(f"gen.batch_size must be 1 for the leaderboard, got {batch_size!r}: it times every prompt "
                             "alone, each method in turn, so that every ratio compares runs made under the same "
                             "conditions; measure batched speedups with python -m bench gen.batch_size=N "
                             "check_lossless=true, or scripts/batch_speedup.py")
        board = base.leaderboard
        entries = OmegaConf.to_container(board.decoders, resolve=False)  # ${model.drafts.*} resolve later
        labels = registry.table_order(entries, methods, board.get("order") or ())
        board.decoders = {label: entries[label] for label in labels}
        if board.only:
            unknown = [x for x in board.only if x not in labels]
            if unknown:
                raise BenchError(f"leaderboard.only: unknown label(s) {unknown}; choose from {', '.join(labels)}")
            labels = list(dict.fromkeys(board.only))  # in the order given (a preset's order)
        if REFERENCE not in labels:
            raise BenchError(f"the leaderboard needs the {REFERENCE} entry: every ratio is against it")
        if not (isinstance(board.limit, int) and board.limit >= 1):
            raise BenchError(f"leaderboard.limit must be an integer >= 1, got {board.limit!r}")
        if isinstance(board.repeats, bool) or not (isinstance(board.repeats, int) and board.repeats >= 1):
            raise BenchError(f"leaderboard.repeats must be an integer >= 1, got {board.repeats!r}")
        if board.get("turns", "first") not in TURNS:
            raise BenchError(f"leaderboard.turns must be one of {', '.join(TURNS)}, got {board.turns!r}")
        entries = with_drafts(board, base.model, labels)
        base.leaderboard.decoders = entries  # what ran, as it ran: leaderboard.yaml and each config.yaml keep these
        runs = {}
        for ds in board.datasets:
            for label in labels:
                try:
                    cfg = compose("leaderboard", overrides=[*overrides, f"dataset={ds}", f"dataset.limit={board.limit}",
                                                            *entries[label]])
                except Exception as e:  # Hydra's own errors: one line naming the entry
                    raise BenchError(f"leaderboard entry {label} on {ds}: {error_reason(e)}") from None
                cfg.leaderboard.decoders = entries
                runs[ds, label] = cfg
    return base, labels, runs


def precheck(overrides: list[str]) -> None:
    """Before composing: overrides that parse, and config choices (a preset included) that exist,
    else one line naming the choices."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        raise BenchError(f"cannot parse overrides: {error_reason(e)}") from None
    for override in parsed:
        group = override.get_key_element().lstrip("+~").split("@")[0]
        if group in (*GROUPS, "preset") and override.value() is not None:
            value = override.get_value_element_as_str()
            if value not in config_choices(group):
                raise BenchError(f"unknown {group} {value!r}; choose one of: {', '.join(config_choices(group))}")


DRAFT = re.compile(r"\$\{model\.drafts\.([\w.-]+)\}")


def with_drafts(board, model, labels: list[str]) -> dict[str, list[str]]:
    """The entries' overrides with ${model.drafts.<kind>} replaced by the model config's draft (a
    hub id or path; null: an untrained one), so the spec_bench preset's entries take each target's
    published drafts. An entry that is not run and names a draft this model lacks is left out; one
    that is run is refused in one line."""
    drafts = model.get("drafts") or {}
    entries = {}
    for label, overrides in OmegaConf.to_container(board.decoders, resolve=False).items():
        missing = [kind for o in overrides for kind in DRAFT.findall(o) if kind not in drafts]
        if missing and label in labels:
            raise BenchError(f"leaderboard entry {label} needs model.drafts.{missing[0]}, but model {model.name} names "
                             f"{'only ' + ', '.join(drafts) if drafts else 'no drafts'}; leave the entry out "
                             f"(leaderboard.only=[...]) or give it one: leaderboard.decoders.{label}=[...]")
        if not missing:
            entries[label] = [DRAFT.sub(lambda m: "null" if drafts[m.group(1)] is None else str(drafts[m.group(1)]), o)
                              for o in overrides]
    return entries


def target_fit(decoders: list) -> dict:
    """What the one target every entry shares must fit beside: all their drafts and heads, and the
    widest step any of them takes."""
    return {"add_ons": sum(map(addon_bytes, decoders)), "step": max(map(widest_step, decoders))}


def run_dataset(ds: str, labels: list[str], runs: dict, out_dir: Path, lm_cache: dict,
                repeats: int = 1, turns: str = "first") -> dict[str, list[dict]]:
    """Runs what is missing of one dataset; returns per label the records of this run's prompts, in
    prompt order (a directory may hold more, from an earlier run with a larger limit). With
    repeats > 1 each prompt runs `repeats` times per label, the order rotating per run; a label's
    record (that of its first run) is written after its last, with every run's latency in
    repeat_latency_s. turns="all": every turn of a conversation, each after that label's own
    answers to the turns before it (as in a plain run)."""
    cfgs = {label: runs[ds, label] for label in labels}
    first = cfgs[REFERENCE]
    decoders = {}
    for label, cfg in cfgs.items():
        _, decoders[label] = check_config(cfg)
    dataset = build(first.dataset, "dataset")
    prompts = dataset.load()
    logs = {}
    for label, cfg in cfgs.items():
        run_dir = out_dir / ds / label
        rundir.claim(run_dir)
        logs[label] = RecordLog(run_dir / "records.jsonl", resume=True, settings=record_settings(cfg))
        rundir.write_run_files(run_dir, cfg)  # config.yaml, whole or not at all
    units = [(p, t) for p in prompts for t in (range(len(p.turns)) if turns == "all" else [0])]
    keys = [f"{p.id}#{t}" for p, t in units]
    todo = [key for key in keys for label in labels if key not in logs[label]]

    def records() -> dict[str, list[dict]]:  # the logs hold them: no need to read the files again
        return {label: [log.get(k) for k in keys if k in log] for label, log in logs.items()}

    bar = None
    try:
        if not todo:
            return records()
        if "lm" not in lm_cache:
            # one target for every entry, beside all their drafts and heads: the estimate counts them all
            lm_cache["lm"] = build(first.model, "model").load(**target_fit(list(decoders.values())))
        lm = lm_cache["lm"]
        rendering = rendering_for(lm.tokenizer, first.prompt_format)
        sampling, _ = check_config(first)
        ctxs = {label: RunContext(lm, dec, dataset, rendering, cfgs[label], sampling)
                for label, dec in decoders.items()}
        calibration = {}
        with torch.inference_mode():
            for label, ctx in ctxs.items():
                calibration[label] = prepare_decoder(ctx, prompts)
                if first.warmup:
                    warmup(ctx, units)
        total = len(units) * len(labels) * repeats
        bar = tqdm(total=total, initial=total - len(todo) * repeats, unit="run", desc=f"leaderboard | {ds}",
                   dynamic_ncols=True, disable=not first.progress)
        pace = {label: Pace() for label in labels}
        with torch.inference_mode():
            for i, (prompt, turn) in enumerate(units):
                key = f"{prompt.id}#{turn}"
                first_run: dict[str, dict] = {}
                latencies: dict[str, list[float]] = {}
                # What a decoder carries between prompts (recycling's hot table) before this prompt's
                # first run and after it: every later timed run starts from the former, the next prompt
                # from the latter, so no repeat drafts from its own earlier run. One run: nothing to keep.
                before = {label: carried_copy(ctx.decoder, lm) for label, ctx in ctxs.items()} if repeats > 1 else {}
                after: dict[str, dict | None] = {}
                for rep in range(repeats):
                    shift = (i * repeats + rep) % len(labels)  # no method always runs first
                    for label in labels[shift:] + labels[:shift]:
                        if key in logs[label]:
                            continue
                        earlier = [logs[label].get(f"{prompt.id}#{t}") for t in range(turn)]  # this label's own answers
                        record = skipped_turn(cfgs[label], prompt, turn, earlier)
                        if record is None:
                            if rep:
                                carry(ctxs[label].decoder, lm, before[label])
                            record = run_unit(ctxs[label], prompt, turn, [r["text"] for r in earlier])
                            if repeats > 1 and label not in after:  # the first run's, copied once
                                after[label] = carried_copy(ctxs[label].decoder, lm)
                        first_run.setdefault(label, record)
                        if record["status"] == "ok":
                            latencies.setdefault(label, []).append(record["latency_s"])
                            bar.set_postfix(decoder=label, **pace[label].add(record), refresh=False)
                        bar.update(1)
                for label, state in after.items():
                    carry(ctxs[label].decoder, lm, state)
                # every label's runs of this prompt are done: judge (untimed), then record
                if sampling.greedy:
                    judge(lm, rendering, first_run, first_run.get(REFERENCE) or logs[REFERENCE].get(key))
                for label, record in first_run.items():
                    record["label"] = label
                    if record["status"] == "ok":
                        record["repeat_latency_s"] = latencies[label]
                    if calibration[label] is not None:
                        record["calibration"] = calibration[label]
                    logs[label].append(record)
    finally:
        if bar is not None:  # before any message after it (Ctrl-C's hint comes last)
            bar.close()
        for log in logs.values():
            log.close()
    return records()


def judge(lm, rendering: str, records: dict[str, dict], reference: dict | None) -> None:
    """Greedy: each new record's lossless check (bench/metrics.py, judge_output) against the
    autoregressive entry's output of the same prompt, from the target's one-token steps along the
    record's output (untimed), so that a departure at a tie is told from a loss. A record already
    judged (check_lossless=true: against its own autoregressive run) is kept as it is; one whose
    prompt differs from autoregressive's (a later turn after other answers) is left unjudged."""
    if reference is None or reference["status"] != "ok":
        return
    for record in records.values():
        if (record["status"] == "ok" and record.get("lossless") is None
                and record["prompt_text"] == reference["prompt_text"]):
            ids = encode(lm.tokenizer, record["prompt_text"], rendering)
            record.update(judge_lossless(lm, ids, record["tokens"], reference["tokens"]))


def verification_cost(lm, tokens: list[int]) -> pd.DataFrame:
    """Latency of one forward of k tokens (tree-style: mask and positions) after a 256-token
    context, relative to one autoregressive step (decoders/tuning/profile.py: fastest of 5 rounds)."""
    from decoders.tuning.profile import measure_forward_latency

    latency, step = measure_forward_latency(lm, max_tokens=max(tokens))
    return pd.DataFrame({"tokens": tokens, "latency_ms": [latency[k - 1] * 1e3 for k in tokens],
                         "vs_one_token": [latency[k - 1] / step for k in tokens]})


def main(argv: list[str] | None = None) -> None:
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        base, labels, runs = compose_all(overrides)
        board = base.leaderboard
        out_dir = Path(board.out_dir)
        rundir.check_board_dir(out_dir)  # only a new or empty directory, or a leaderboard's own
        check_writable("leaderboard.out_dir", board.out_dir)  # one line and exit 2, as for hydra.run.dir
        if base.threads:
            torch.set_num_threads(base.threads)
        for (ds, label), cfg in runs.items():  # every entry before any runs: a refusal changes nothing
            # the leaderboard's own keys and the prompt count may change: raising the limit extends a run
            rundir.check_resume(out_dir / ds / label, cfg, True, "leaderboard.out_dir",
                                ignore=("leaderboard", "dataset.limit"))
        # The target and every entry's drafts and heads, loaded before anything is claimed: one that
        # does not fit, load or match writes nothing.
        decoders = [check_config(runs[board.datasets[0], label])[1] for label in labels]
        lm = build(runs[board.datasets[0], REFERENCE].model, "model").load(**target_fit(decoders))
        for decoder in decoders:
            load_addons(decoder, lm)
        rundir.claim_board(out_dir)
        records = {(ds, label): recs for ds in board.datasets
                   for label, recs in run_dataset(ds, labels, runs, out_dir, {"lm": lm}, board.repeats,
                                                  board.get("turns", "first")).items()}
        write_summaries(out_dir, records)
        greedy = sampling_from(runs[board.datasets[0], REFERENCE]).greedy
        df = table(records, list(board.datasets), labels)
        by_category = category_table(records, list(board.datasets), labels)
        if not greedy:  # the lossless check is greedy's (check_lossless refuses sampling): no such columns
            df, by_category = (d.drop(columns=[c for c in LOSSLESS_COLUMNS if c in d]) for d in (df, by_category))
        rundir.write_atomic(out_dir / "leaderboard.csv", df.to_csv(index=False))
        # auto-tuners: forecast vs measured
        rundir.write_atomic(out_dir / "tuning.csv", tuning_table(df, records).to_csv(index=False))

        # Spec-Bench's layout, where prompts have categories
        spec_bench_table.write(out_dir, records, list(board.datasets), labels)
        if len(by_category):
            rundir.write_atomic(out_dir / "leaderboard_by_category.csv", by_category.to_csv(index=False))
            rundir.write_atomic(out_dir / "leaderboard_by_category.md",
                by_category[[c for c in CATEGORY_COLUMNS if c in by_category]]
                .to_markdown(index=False, floatfmt=".3g") + "\n")
        from .leaderboard_plots import plot_all

        cost = verification_cost(lm, list(board.verification_tokens))
        rundir.write_atomic(out_dir / "verification_cost.csv", cost.to_csv(index=False))
        plot_all(out_dir, list(board.datasets), labels, df, list(board.sweeps), records)
        from . import provenance
        info = provenance.collect(lm)
        # how the table was asked for: the command line (a preset: +preset=<name>) and the entries it ran
        info["leaderboard"] = {"overrides": overrides, "labels": labels, "datasets": list(board.datasets),
                               "limit": board.limit, "repeats": board.repeats, "turns": board.get("turns", "first")}
        rundir.write_atomic(out_dir / "provenance.json", json.dumps(info, indent=2))
        rundir.write_atomic(out_dir / "leaderboard.yaml", OmegaConf.to_yaml(base, resolve=True))
        md = markdown(df, cost, base, lm)
        rundir.write_atomic(out_dir / "leaderboard.md", md)
        print(md)
    except BenchError as e:
        print(f"error: {' '.join(error_reason(e).split())}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # every finished record is on disk; the same command resumes
        print("\ninterrupted: the finished records are kept; rerun the same command to go on", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
