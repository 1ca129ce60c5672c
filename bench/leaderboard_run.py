"""The leaderboard's run (bench/leaderboard.py), once its settings passed: the one target loaded
beside every entry's drafts and heads, each dataset's prompts run by every entry in a rotating
order, then the tables, plots and provenance written into leaderboard.out_dir.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from decoders.core.contract import CarriesState, carried_copy, carry, widest_step
from decoders.core.weights_file import addon_bytes

from . import drift, provenance, rundir
from .__main__ import check_devices
from .leaderboard_tables import machine, markdown, write_summaries, write_tables
from .prompts import encode, rendering_for
from .records import RecordLog
from .registry import REFERENCE
from .runner import (Pace, RunContext, budget, build, check_config, check_finite_logits, judge_lossless, load_addons,
                     model_identity, prepare_decoder, record_settings, run_identity, run_unit, sampling_from,
                     skipped_turn, start_unit, warmup)
from .slurm import signals_held


def run_board(base: DictConfig, labels: list[str], runs: dict, overrides: list[str]) -> str:
    """Runs what is missing of every dataset's entries, then writes everything into
    leaderboard.out_dir; returns leaderboard.md's text. `runs`: (dataset, label) -> run config."""
    board = base.leaderboard
    out_dir, datasets = Path(board.out_dir), list(board.datasets)
    check_devices(base)
    if base.threads:
        torch.set_num_threads(base.threads)
    lm = load_target({label: runs[datasets[0], label] for label in labels})
    for ds in datasets:  # every entry's records made as these would be, before anything is written
        checked_identity(build(runs[ds, REFERENCE].dataset, "dataset").load(), labels, out_dir / ds, lm)
    rundir.claim_board(out_dir)
    speed: dict[str, dict] = {}  # per dataset run now: the target's step before and after (bench/drift.py)
    records = {(ds, label): recs for ds in datasets
               for label, recs in run_dataset(ds, labels, runs, out_dir, {"lm": lm}, repeats=board.repeats,
                                              turns=board.get("turns", "first"), speed=speed).items()}
    write_summaries(out_dir, records)
    df = write_tables(out_dir, records, datasets, labels, greedy=sampling_from(runs[datasets[0], REFERENCE]).greedy)
    from .leaderboard_plots import plot_all
    from .plotting import setup_of

    cost = verification_cost(lm, list(board.verification_tokens))
    rundir.write_atomic(out_dir / "verification_cost.csv", cost.to_csv(index=False))
    plot_all(out_dir, datasets, labels, df, list(board.sweeps), records, where=setup_of(lm))
    write_provenance(lm, base, labels, overrides, speed)
    md = markdown(df, {"this device": cost}, base, machine(lm))
    rundir.write_atomic(out_dir / "leaderboard.md", md)
    return md


def target_fit(decoders: list) -> dict:
    """What the one target every entry shares must fit beside: all their drafts and heads, and the
    widest step any of them takes."""
    return {"add_ons": sum(map(addon_bytes, decoders)), "step": max(map(widest_step, decoders))}


def load_target(cfgs: dict[str, DictConfig]):
    """The target, with every entry's drafts and heads (label -> run config), loaded before anything
    is claimed: one that does not fit, load or match writes nothing."""
    decoders = [check_config(cfg)[1] for cfg in cfgs.values()]
    lm = build(cfgs[REFERENCE].model, "model").load(**target_fit(decoders))
    for decoder in decoders:
        load_addons(decoder, lm)
    check_finite_logits(lm)
    return lm


@dataclasses.dataclass
class Entries:
    """One dataset's entries while they run, by label: each one's run context (the shared target,
    its decoder), its records, what they say about its calibration and its progress figures."""

    ctxs: dict[str, RunContext]
    logs: dict[str, RecordLog]
    calibration: dict[str, dict | None]
    repeats: int
    bar: tqdm
    pace: dict[str, Pace]


def run_dataset(ds: str, labels: list[str], runs: dict, out_dir: Path, lm_cache: dict, *,
                repeats: int = 1, turns: str = "first", speed: dict | None = None,
                questions: slice | None = None) -> dict[str, list[dict]]:
    """Runs what is missing of one dataset; returns per label the records of this run's prompts, in
    prompt order (a directory may hold more, from an earlier run with a larger limit). With
    repeats > 1 each prompt runs `repeats` times per label, the order rotating per run; a label's
    record (that of its first run) is written after its last, with every run's latency in
    repeat_latency_s. turns="all": every turn of a conversation, each after that label's own
    answers to the turns before it (as in a plain run). lm_cache["lm"]: the target, loaded if absent.
    speed[ds]: how the target's one-token step before the timed prompts compares with the one after, and
    how the reference's own step moved between them (bench/drift.py). questions: the slice of the
    dataset's prompts to run (a unit of a sharded board); the tuners still calibrate past them all."""
    cfgs = {label: runs[ds, label] for label in labels}
    decoders = {label: check_config(cfg)[1] for label, cfg in cfgs.items()}
    dataset = build(cfgs[REFERENCE].dataset, "dataset")
    prompts = dataset.load()
    identity = checked_identity(prompts, labels, out_dir / ds, lm_cache.get("lm"))
    logs = open_logs(out_dir / ds, cfgs, identity["dataset"]["prompts"])
    scored = prompts[questions or slice(None)]
    units = [(p, t) for p in scored for t in (range(len(p.turns)) if turns == "all" else [0])]
    keys = [f"{p.id}#{t}" for p, t in units]
    todo = sum(key not in logs[label] for key in keys for label in labels)
    bar = None
    try:
        if todo:
            if "lm" not in lm_cache:
                lm_cache["lm"] = load_target(cfgs)
                identity = checked_identity(prompts, labels, out_dir / ds, lm_cache["lm"])
            for label in labels:
                rundir.write_identity(out_dir / ds / label, identity)
            ctxs = contexts(lm_cache["lm"], decoders, dataset, cfgs)
            calibration = prepare_entries(ctxs, prompts, units)
            total = len(units) * len(labels) * repeats
            bar = tqdm(total=total, initial=total - todo * repeats, unit="run", desc=f"leaderboard | {ds}",
                       dynamic_ncols=True, disable=not cfgs[REFERENCE].progress)
            entries = Entries(ctxs, logs, calibration, repeats, bar, {label: Pace() for label in labels})
            replay_carried(entries, units)
            timed = [key for key in keys if key not in logs[REFERENCE]]  # the reference's prompts timed now
            with torch.inference_mode():
                start_ms = drift.step_ms(lm_cache["lm"])
                for i, (prompt, turn) in enumerate(units):
                    record_prompt(entries, f"{prompt.id}#{turn}", *time_prompt(entries, prompt, turn, order=i))
                checked = drift.compare(start_ms, drift.step_ms(lm_cache["lm"]))
            ran = [logs[REFERENCE].get(key) for key in timed]
            checked["during"] = drift.spread([drift.prompt_step_ms(r) for r in ran if r and r["status"] == "ok"])
    finally:
        if bar is not None:  # before any message after it (Ctrl-C's hint comes last)
            bar.close()
        for log in logs.values():
            log.close()
    if todo:
        if speed is not None:
            speed[ds] = checked
        drift.warn(checked, f"{ds}'s timed prompts")
    # the logs hold the records: no need to read the files again
    return {label: [log.get(k) for k in keys if k in log] for label, log in logs.items()}


def checked_identity(prompts: list, labels: list[str], ds_dir: Path, lm=None) -> dict:
    """What defines the records of one dataset's entries (runner.run_identity, with the target's weights
    once it is loaded), checked against each entry's directory (ds_dir/<label>): records made otherwise
    are refused in one line."""
    identity = run_identity(prompts)
    if lm is not None:
        identity["model"] = model_identity(lm)
    for label in labels:
        rundir.check_identity(ds_dir / label, identity, "leaderboard.out_dir")
    return identity


def open_logs(ds_dir: Path, cfgs: dict[str, DictConfig], prompts: dict[str, str]) -> dict[str, RecordLog]:
    """Each entry's run directory (ds_dir/<label>) claimed, its records opened to resume (`prompts`: the
    dataset's content hashes, a record of other text set aside), its config.yaml written."""
    logs = {}
    for label, cfg in cfgs.items():
        run_dir = ds_dir / label
        rundir.claim(run_dir)
        logs[label] = RecordLog(run_dir / "records.jsonl", resume=True, settings=record_settings(cfg),
                                prompts=prompts)
        rundir.write_run_files(run_dir, cfg)  # config.yaml, whole or not at all
    return logs


def contexts(lm, decoders: dict, dataset, cfgs: dict[str, DictConfig]) -> dict[str, RunContext]:
    """Every entry's run context on the one target, with the reference's prompt rendering and
    sampling settings."""
    first = cfgs[REFERENCE]
    rendering = rendering_for(lm.tokenizer, first.prompt_format)
    sampling = sampling_from(first)
    return {label: RunContext(lm, dec, dataset, rendering, cfgs[label], sampling) for label, dec in decoders.items()}


def prepare_entries(ctxs: dict[str, RunContext], prompts: list, units: list) -> dict[str, dict | None]:
    """Every entry's decoder made ready before any timing (runner.prepare_decoder) and warmed up
    where the reference's warmup asks; returns per label what records say about its calibration."""
    calibration = {}
    with torch.inference_mode():
        for label, ctx in ctxs.items():
            calibration[label] = prepare_decoder(ctx, prompts)
            if ctxs[REFERENCE].cfg.warmup:
                warmup(ctx, units)
    return calibration


def replay_carried(entries: Entries, units: list) -> None:
    """An entry that carries state between prompts (recycling's hot table, suffix's trie), resumed
    after some of its prompts, first decodes those again, untimed and in order: it then drafts on from
    the state the uninterrupted run reached, and its steps and acceptance are that run's. An output
    that comes out otherwise than its record (another device's rounding) is said."""
    for label, ctx in entries.ctxs.items():
        log = entries.logs[label]
        done = [(p, t) for p, t in units if f"{p.id}#{t}" in log]
        if not isinstance(ctx.decoder, CarriesState) or not done or len(done) == len(units):
            continue
        print(f"[bench] {label}: {len(done)} finished turns decoded again (untimed) to rebuild what it carries "
              "between prompts", file=sys.stderr, flush=True)
        departed = 0
        with torch.inference_mode():
            for prompt, turn in done:
                earlier = [log.get(f"{prompt.id}#{t}") for t in range(turn)]
                if skipped_turn(ctx.cfg, prompt, turn, earlier) is not None:
                    continue
                record, ids, sampling = start_unit(ctx, prompt, turn, [r["text"] for r in earlier])
                if record["status"] == "ok":
                    gen = ctx.decoder.generate(ctx.lm, ids, budget(ctx, ids), sampling, ctx.lm.stop_ids)
                    departed += gen.tokens != log.get(f"{prompt.id}#{turn}")["tokens"]
        if departed:
            print(f"[bench] warning: {label}: {departed} of {len(done)} turns decoded again differ from their records, "
                  "so its state between prompts differs from the interrupted run's", file=sys.stderr, flush=True)


def time_prompt(entries: Entries, prompt, turn: int, order: int) -> tuple[dict[str, dict], dict[str, list[float]]]:
    """Every entry's timed runs of one prompt's turn that its log lacks, entries.repeats each, in an
    order rotated by `order` (no method always runs first). Returns per label its first run's
    record and every ok run's latency."""
    key, labels, repeats = f"{prompt.id}#{turn}", list(entries.ctxs), entries.repeats
    lm = entries.ctxs[REFERENCE].lm
    first_run: dict[str, dict] = {}
    latencies: dict[str, list[float]] = {}
    # What a decoder carries between prompts (recycling's hot table) before this prompt's first run
    # and after it: every later timed run starts from the former, the next prompt from the latter,
    # so no repeat drafts from its own earlier run. One run: nothing to keep.
    before = {label: carried_copy(ctx.decoder, lm) for label, ctx in entries.ctxs.items()} if repeats > 1 else {}
    after: dict[str, dict | None] = {}
    for rep in range(repeats):
        shift = (order * repeats + rep) % len(labels)
        for label in labels[shift:] + labels[:shift]:
            if key in entries.logs[label]:
                continue
            ctx = entries.ctxs[label]
            earlier = [entries.logs[label].get(f"{prompt.id}#{t}") for t in range(turn)]  # this label's own answers
            record = skipped_turn(ctx.cfg, prompt, turn, earlier)
            if record is None:
                if rep:
                    carry(ctx.decoder, lm, before[label])
                record = run_unit(ctx, prompt, turn, [r["text"] for r in earlier])
                if repeats > 1 and label not in after:  # the first run's, copied once
                    after[label] = carried_copy(ctx.decoder, lm)
            first_run.setdefault(label, record)
            if record["status"] == "ok":
                latencies.setdefault(label, []).append(record["latency_s"])
                entries.bar.set_postfix(decoder=label, **entries.pace[label].add(record), refresh=False)
            entries.bar.update(1)
    for label, state in after.items():
        carry(entries.ctxs[label].decoder, lm, state)
    return first_run, latencies


def record_prompt(entries: Entries, key: str, first_run: dict[str, dict], latencies: dict[str, list[float]]) -> None:
    """Once every label's runs of a prompt are done: their first runs judged (greedy, untimed),
    then recorded with every run's latency."""
    reference = entries.ctxs[REFERENCE]
    if reference.sampling.greedy:
        judge(reference.lm, reference.rendering, first_run,
              first_run.get(REFERENCE) or entries.logs[REFERENCE].get(key))
    node = provenance.node()
    for label, record in first_run.items():
        record["label"] = label
        record["node"] = node  # each record's: a resumed run may go on elsewhere
        if record["status"] == "ok":
            record["repeat_latency_s"] = latencies[label]
        if entries.calibration[label] is not None:
            record["calibration"] = entries.calibration[label]
    # Written together, a stop waiting the milliseconds of the appends: no entry's record of a prompt
    # is kept while the reference's is timed again, later, maybe on another node.
    with signals_held():
        for label, record in first_run.items():
            entries.logs[label].append(record)


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


def write_provenance(lm, base: DictConfig, labels: list[str], overrides: list[str], speed: dict) -> None:
    """provenance.json (what ran, on what, how the table was asked for, and per dataset run now the
    speed check of bench/drift.py) and leaderboard.yaml (the composed config)."""
    board = base.leaderboard
    out_dir = Path(board.out_dir)
    info = provenance.collect(lm)
    # how the table was asked for: the command line (a preset: +preset=<name>) and the entries it ran
    info["leaderboard"] = {"overrides": overrides, "labels": labels, "datasets": list(board.datasets),
                           "limit": board.limit, "repeats": board.repeats, "turns": board.get("turns", "first")}
    info["reference_step"] = speed
    rundir.write_atomic(out_dir / "provenance.json", json.dumps(info, indent=2))
    rundir.write_atomic(out_dir / "leaderboard.yaml", OmegaConf.to_yaml(base, resolve=True))
