"""One run: one decoder x one model x one dataset -> records.jsonl, summary.csv/.md, provenance."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import sys
import time
import zlib
from pathlib import Path

import pandas as pd
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError
from tqdm.auto import tqdm

from decoders.core.batch import decode_batch, latencies
from decoders.core.contract import (Batches, Decoder, LoadsAddOns, ReportsTuning, SelfTuning, check_engine,
                                    check_sampling, foresee, kept_as_is, widest_step)
from decoders.core.sampling import NonFiniteLogits, Sampling, argmax
from decoders.core.trace import check_generation
from decoders.core.weights_file import addon_bytes
from decoders.methods.autoregressive import autoregressive_decode, referee_logits, step_logits

from . import drift, metrics, provenance, rundir, slurm
from .datasets import prompt_sha256
from .errors import BenchError
from .llamacpp_models import engine_of
from .prompts import capped_stop_reason, new_token_budget, prepare, rendering_for
from .records import RecordLog
from .rundir import record_settings
from .settings import check_gen_settings, check_seed, check_settings
from .spec_bench_table import speed_py_tokens
from .targets import check_targets

def build(node: DictConfig, what: str):
    """hydra.utils.instantiate, with invalid hyper-parameters reported as one line; only this
    project's classes may be built (bench/targets.py)."""
    try:
        check_targets(node, f"{what}.", resolve=True)
    except InterpolationKeyError as e:
        raise BenchError(f"{what}: {unset_key(node, e)}") from None
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as e:
        cause = e.__cause__ or e
        if isinstance(cause, (ValueError, TypeError, BenchError)):
            raise BenchError(f"{what}: {cause}") from None
        raise


def unset_key(node: DictConfig, e: InterpolationKeyError) -> str:
    """A setting that reads a key its config does not set, in words: an add-on's default
    (${model.drafts.<kind>}: the model config's file) where the model names none of that kind."""
    root = node._get_root()
    raw = OmegaConf.to_container(root, resolve=False)
    for part in str(e.full_key).split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    kind = re.search(r"\$\{model\.drafts\.([\w-]+)\}", str(raw))
    if kind is None:
        return f"{e.full_key}={raw}: {e.msg}"
    model = root.get("model") or {}
    drafts = ", ".join(model.get("drafts") or {}) or "none"
    return (f"{e.full_key} is the model's {kind.group(1)} add-on (model.drafts.{kind.group(1)}), and model "
            f"{model.get('name')} names none (its drafts: {drafts}); give {e.full_key}=FILE or a published "
            "checkpoint, or null for an untrained one")


def recorded_spec(run_dir: Path, group: str, **overrides):
    """The `group` spec (model, dataset) a run directory's config.yaml recorded, built as a run
    builds it (only this project's classes), with `overrides` set. A damaged, foreign or
    unresolvable file is one line naming it."""
    found = rundir.recorded_config(run_dir, "run directory")
    if found is None:
        raise BenchError(f"{run_dir} has no config.yaml: give a run directory written by python -m bench")
    path, cfg = found
    node = cfg.get(group)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        shown = "has no _target_" if isinstance(node, DictConfig) else f"is {node!r}"
        raise BenchError(f"{path}: {group} {shown}, not the settings python -m bench writes (a mapping with "
                         "_target_); restore the file")
    node = node.copy()
    for key, value in overrides.items():
        node[key] = value
    try:
        return build(node, group)
    except Exception as e:  # the file is data: an unknown key, a wrong type, a class that fails to build
        reason = " ".join(str(e).split()[:40]) or type(e).__name__
        raise BenchError(f"{path}: its {group} settings cannot be built ({reason}); restore the file") from None


def sampling_from(cfg: DictConfig) -> Sampling:
    """The run's sampling settings: their types checked first (bench/settings.py), their ranges by Sampling."""
    check_gen_settings(cfg)
    check_seed(cfg.seed)
    gen = cfg.gen
    try:
        return Sampling(temperature=float(gen.temperature), top_p=float(gen.top_p), top_k=gen.top_k, seed=cfg.seed)
    except (ValueError, TypeError) as e:
        raise BenchError(str(e)) from None


def check_config(cfg: DictConfig) -> tuple[Sampling, object]:
    """Everything that can be checked without loading a model or data (the run's own settings, the
    sampling settings, the decoder and the model spec built): used before a (multi)run starts and
    again by each run. Returns the sampling settings and the decoder."""
    check_targets(cfg)  # before anything is instantiated
    check_settings(cfg)
    sampling = sampling_from(cfg)
    decoder = build(cfg.decoder, "decoder")
    if not isinstance(decoder, Decoder):
        raise BenchError(f"decoder: {type(decoder).__name__} is not a decoder: it needs name, lossless and "
                         f"generate(lm, prompt_ids, max_new_tokens, sampling, stop_ids) (decoders/core/contract.py)")
    try:
        check_sampling(decoder, sampling)  # a greedy-only decoder (the oracle) refuses gen.temperature > 0
    except ValueError as e:
        raise BenchError(str(e)) from None
    size = cfg.gen.get("batch_size", 1)
    if size > 1 and not isinstance(decoder, Batches):
        raise BenchError(f"decoder {decoder.name} decodes one prompt at a time, "
                         f"so gen.batch_size must be 1, got {size} "
                         "(every decoder with proposer() batches; the hf_* peers decode one prompt at a time)")
    # the spec only (nothing loads): its settings are checked before any directory is claimed
    spec = build(cfg.model, "model")
    try:
        check_engine(decoder, *engine_of(spec))  # what the decoder reads of its target, where the engine gives it
    except ValueError as e:
        raise BenchError(str(e)) from None
    return sampling, decoder


def prompt_seed(seed: int, key: str) -> int:
    """Per-prompt seed, independent of order and of resumption."""
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63)


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What every prompt of a run is decoded with, built once per run (per leaderboard entry):
    the loaded model, the decoder, the dataset (it scores), the prompt rendering (chat or raw),
    the run's config and its sampling settings (each prompt derives its own seed from them)."""

    lm: object
    decoder: object
    dataset: object
    rendering: str
    cfg: DictConfig
    sampling: Sampling


def run_identity(prompts: list) -> dict:
    """What defines a run's results besides its settings (config.yaml): the content of the prompts it
    uses and the code that runs them; model_identity adds the weights once they load. A run directory
    records it (rundir.IDENTITY) and a resume must match it."""
    return {"dataset": rundir.dataset_identity({p.id: prompt_sha256(p) for p in prompts}),
            "code": provenance.code_identity()}


def model_identity(lm) -> dict:
    return {"name": lm.name, "weights": getattr(lm, "weights_id", None)}


def new_record(cfg: DictConfig, prompt, turn: int, **fields) -> dict:
    """A record's identifying fields (key, prompt and its content hash, decoder, model, dataset,
    category) with status ok, then `fields`: also the whole record of a prompt that is skipped."""
    return {"key": f"{prompt.id}#{turn}", "prompt_id": prompt.id, "turn": turn, **record_settings(cfg),
            "prompt_sha256": prompt_sha256(prompt), "category": prompt.meta.get("category"), "status": "ok",
            "reason": None, **fields}


def skipped_turn(cfg: DictConfig, prompt, turn: int, earlier: list[dict | None]) -> dict | None:
    """The record of a turn that cannot run because an earlier turn of its conversation (`earlier`:
    their records, None where missing) was skipped; None where it can run."""
    if any(r is None or r["status"] != "ok" for r in earlier):
        return new_record(cfg, prompt, turn, status="skipped",
                          reason="an earlier turn of this conversation was skipped")
    return None


@dataclasses.dataclass
class Pace:
    """The progress bar's running figures over the generations so far."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0

    def add(self, record: dict) -> dict:
        """Counts an "ok" record in; returns the bar's postfix."""
        self.tokens += record["new_tokens"]
        self.steps += record["steps"]
        self.seconds += record["latency_s"]
        return {"tok_s": f"{self.tokens / self.seconds:.1f}", "tok_per_step": f"{self.tokens / self.steps:.2f}"}


def run_unit(ctx: RunContext, prompt, turn: int, previous: list[str]) -> dict:
    """One prompt's turn, decoded and timed alone; `previous`: the run's own answers to the turns before."""
    record, ids, sampling = start_unit(ctx, prompt, turn, previous)
    if record["status"] != "ok":
        return record
    lm = ctx.lm
    with finite_logits(ctx, f"decoder {ctx.decoder.name} on prompt {record['key']}", ids):
        foresee(ctx.decoder, lm, ids, budget(ctx, ids), lm.stop_ids)  # untimed: before the clock (the oracle's)
        lm.sync()
        start = time.perf_counter()
        gen = ctx.decoder.generate(lm, ids, budget(ctx, ids), sampling, lm.stop_ids)
        lm.sync()
        return finish_unit(ctx, record, prompt, turn, ids, gen, latency=time.perf_counter() - start)


def run_batch(ctx: RunContext, units: list, log) -> list[dict]:
    """units: (prompt, turn) pairs decoded together (decoders/core/batch.py); a unit that cannot run
    (too long) is skipped and the rest go on. Records as run_unit's, each with its row's latency and
    TTFT from the batch's start, plus the batch's own totals under "batch" (metrics.batch_totals)."""
    started = []
    for prompt, turn in units:
        previous = [log.get(f"{prompt.id}#{t}")["text"] for t in range(turn)]
        started.append((prompt, turn, *start_unit(ctx, prompt, turn, previous)))
    ready = [s for s in started if s[2]["status"] == "ok"]
    with finite_logits(ctx, f"decoder {ctx.decoder.name} on the batch of {', '.join(r[2]['key'] for r in ready)}"):
        _decode_ready(ctx, ready)
    return [record for _, _, record, _, _ in started]


def _decode_ready(ctx: RunContext, ready: list) -> None:
    """run_batch's decoding of the rows that can run, their records finished in place."""
    if ready:
        lm = ctx.lm
        rows = [ids for *_, ids, _ in ready]
        for ids in rows:  # untimed: before the batch's clock (the oracle's pre-pass)
            foresee(ctx.decoder, lm, ids, budget(ctx, ids), lm.stop_ids)
        lm.sync()
        gens, stats = decode_batch(ctx.decoder, lm, rows, [budget(ctx, ids) for ids in rows], [s for *_, s in ready],
                                   lm.stop_ids)
        batch = {"id": ready[0][2]["key"], "size": ctx.cfg.gen.batch_size, **stats.as_dict()}
        batch["tokens_per_s"] = sum(len(g.tokens) for g in gens) / stats.wall_s
        for (prompt, turn, record, ids, _), gen in zip(ready, gens):
            finish_unit(ctx, record, prompt, turn, ids, gen, latency=latencies([gen])[0])
            record["batch"] = batch


def start_unit(ctx: RunContext, prompt, turn: int, previous: list[str]):
    """The record before decoding (status skipped when the prompt cannot run), the prompt's ids and
    its own sampling seed."""
    lm, cfg = ctx.lm, ctx.cfg
    text, ids, unfit = prepare(lm.tokenizer, prompt, turn, previous, ctx.rendering, lm.max_context)
    # decoder_lossless: False for explicitly lossy variants (e.g. Medusa's typical acceptance).
    record = new_record(cfg, prompt, turn, rendering=ctx.rendering, prompt_tokens=None if ids is None else len(ids),
                        prompt_text=text, decoder_lossless=bool(ctx.decoder.lossless),
                        quality_metric=ctx.dataset.quality_metric, quality_score=None, quality=None, lossless=None,
                        reference=None)
    if unfit:  # empty, or filling the context by itself: skipped with its reason, the run goes on
        record.update(status="skipped", reason=unfit)
    return record, ids, dataclasses.replace(ctx.sampling, seed=prompt_seed(ctx.sampling.seed, record["key"]))


def budget(ctx: RunContext, ids) -> int:
    """This prompt's new tokens: gen.max_new_tokens, cut where the context ends."""
    return new_token_budget(ctx.cfg.gen.max_new_tokens, ctx.lm.max_context, len(ids))


def finish_unit(ctx: RunContext, record: dict, prompt, turn: int, ids, gen, *, latency: float) -> dict:
    """Metrics, output, the lossless check and quality, into the record."""
    lm, decoder, cfg = ctx.lm, ctx.decoder, ctx.cfg
    max_new = budget(ctx, ids)
    check_generation(gen, max_new, lm.stop_ids)
    output = lm.tokenizer.decode(gen.tokens, skip_special_tokens=True)
    record.update(metrics.generation_metrics(gen, lm.flops_spec(), latency))
    record["stop_reason"] = capped_stop_reason(len(gen.tokens), gen.stop_reason, cfg.gen.max_new_tokens)
    record.update(tokens=gen.tokens, text=output, trace=gen.trace_columns(),
                  speed_py_tokens=speed_py_tokens(lm.tokenizer, output))  # Spec-Bench's count of a baseline's
    tuning = decoder.tuning if isinstance(decoder, ReportsTuning) else None
    if tuning:  # what "auto" resolved to, and the speedup it predicted (compare: speedup)
        record["tuned"] = {k: v for k, v in tuning.items() if k != "table"}
    if cfg.check_lossless:
        lm.sync()
        start = time.perf_counter()
        ref = autoregressive_decode(lm, ids, max_new, Sampling(), lm.stop_ids)  # timed as a plain run
        lm.sync()
        ref_latency = time.perf_counter() - start
        record.update(judge_lossless(lm, ids, gen.tokens, ref.tokens))  # after the clock
        record["reference"] = {"decoder": "autoregressive", "latency_s": ref_latency, "new_tokens": len(ref.tokens),
                               "steps": len(ref.steps), "ttft_s": ref.ttft,
                               "tokens_per_s": len(ref.tokens) / ref_latency}
    if cfg.quality:
        scored = ctx.dataset.score(prompt, turn, output, ctx.rendering)
        if scored is not None:
            record["quality"] = scored
            record["quality_score"] = float(scored["score"])
    return record


def judge_lossless(lm, ids, tokens: list[int], reference: list[int]) -> dict:
    """lossless, first_divergence and, where the output departs, whether it departs at ties only
    (bench/metrics.py, judge_output), from the target's own one-token steps along the output and,
    where one is no tie, the same weights in a wider dtype."""
    with torch.inference_mode():
        return metrics.judge_output(tokens, reference, step_logits(lm, ids, tokens),
                                    referee=referee_logits(lm, ids, tokens))


def run(cfg: DictConfig, run_dir: Path, logger=None, hydra: DictConfig | None = None,
        key: str = "hydra.run.dir") -> pd.DataFrame:
    """`logger` is started once the run holds the directory; `hydra`: Hydra's config of this job,
    saved into .hydra/ then; `key`: the setting that chose run_dir, for messages."""
    run_dir = Path(run_dir)
    sampling, decoder = check_config(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dataset = build(cfg.dataset, "dataset")
    prompts = dataset.load()
    if not prompts:
        raise BenchError(f"dataset {cfg.dataset.name} has no prompts")
    if cfg.quality and hasattr(dataset, "check_scoring"):
        dataset.check_scoring()  # e.g. HumanEval's sandbox: refuse now, not after the first generation

    rundir.check_resume(run_dir, cfg, cfg.resume, key)  # a refused run writes nothing
    identity = run_identity(prompts)
    rundir.check_identity(run_dir, identity, key)  # the prompts and the code, before the model loads
    # Loaded before the claim, so that a target that does not fit (the decoder's widest step and
    # add-ons counted) or a draft, heads or n-gram file that does not load or match is refused with
    # nothing written.
    lm = build(cfg.model, "model").load(batch=cfg.gen.batch_size, add_ons=addon_bytes(decoder),
                                        step=widest_step(decoder))
    identity["model"] = model_identity(lm)
    rundir.check_identity(run_dir, {"model": identity["model"]}, key)
    load_addons(decoder, lm)
    check_finite_logits(lm)
    rundir.claim(run_dir)
    units = [(p, t) for p in prompts for t in range(len(p.turns))]
    log = RecordLog(run_dir / "records.jsonl", resume=cfg.resume, keys={f"{p.id}#{t}" for p, t in units},
                    settings=record_settings(cfg), prompts=identity["dataset"]["prompts"])
    try:
        if logger is not None:  # now, not before: wandb writes into the directory
            logger.start(cfg, run_dir)
        rundir.write_run_files(run_dir, cfg, hydra)
        rundir.write_identity(run_dir, identity)
    except BaseException:
        log.close()
        raise

    try:
        if any(f"{p.id}#{t}" not in log for p, t in units):
            rundir.write_atomic(run_dir / "provenance.json", json.dumps(provenance.collect(lm), indent=2))
            ctx = RunContext(lm, decoder, dataset, rendering_for(lm.tokenizer, cfg.prompt_format), cfg, sampling)
            keep_reference_step(run_dir, _generate_all(ctx, units, log, logger))
    finally:
        log.close()
    records = [log.get(f"{p.id}#{t}") for p, t in units]
    summary = metrics.summarize(records)
    rundir.write_atomic(run_dir / "summary.csv", summary.to_csv(index=False))
    rundir.write_atomic(run_dir / "summary.md", metrics.to_markdown(summary) + "\n")
    if any(r.get("category") for r in records):  # MT-Bench's eight, or a jsonl's category field
        by_category = metrics.summarize(records, by_category=True)
        rundir.write_atomic(run_dir / "summary_by_category.csv", by_category.to_csv(index=False))
    if logger is not None:
        logger.log_summary(summary)
    return summary


def _groups(units: list, log: RecordLog, size: int):
    """The units not yet recorded, `size` at a time. With size 1, in order (each turn right after the
    one before). Batched, turn by turn: a conversation's turn t+1 renders turn t's output, so all
    first turns are decoded (and recorded) before any second turn is batched."""
    todo = [(p, t) for p, t in units if f"{p.id}#{t}" not in log]
    if size == 1:
        yield from ([u] for u in todo)
        return
    for turn in sorted({t for _, t in todo}):
        wave = [(p, t) for p, t in todo if t == turn]
        for i in range(0, len(wave), size):
            yield wave[i:i + size]


PROBE = "The quick brown fox jumps over the lazy dog."


def check_finite_logits(lm) -> None:
    """One forward of a short text once the model is loaded, before a run claims its directory: a model
    whose logits are not finite (NaN in its weights) is refused now, not decoded into token 0 at every
    step and judged lossless against a reference as broken."""
    ids = list(lm.tokenizer(PROBE)["input_ids"]) if lm.tokenizer is not None else []
    with torch.inference_mode():
        try:
            argmax(lm.forward(ids or [0], lm.new_cache(), last_only=True)[-1])
        except NonFiniteLogits as e:
            raise BenchError(non_finite(lm, f"model {lm.name}, a forward of {len(ids or [0])} tokens", e)) from None


def non_finite(lm, where: str, e: NonFiniteLogits) -> str:
    return (f"{where}: {e}; the weights of {lm.name} or of its draft hold NaN or inf, or {str(lm.dtype)[6:]} "
            "overflows: check the model's files (a damaged cached copy: delete it and it is made again), or run "
            "with dtype=float32")


@contextlib.contextmanager
def finite_logits(ctx: RunContext, where: str, ids=None):
    """NonFiniteLogits inside: the run stops in one line naming where. A decoder's own loop does not say
    at which step; autoregressive greedy along the same prompt then does."""
    try:
        yield
    except NonFiniteLogits as e:
        if e.step is None and ids is not None:
            try:
                autoregressive_decode(ctx.lm, ids, budget(ctx, ids), Sampling(), ctx.lm.stop_ids)
            except NonFiniteLogits as first:
                e = first
        raise BenchError(non_finite(ctx.lm, where, e)) from None


def warmup(ctx: RunContext, units: list) -> None:
    """One short untimed generation per method (and of the lossless check's autoregressive), so
    first-call costs (allocator growth, kernel selection) are not charged to the first prompt."""
    with finite_logits(ctx, f"decoder {ctx.decoder.name}'s warm-up"):
        _warmup(ctx, units)


def _warmup(ctx: RunContext, units: list) -> None:
    lm, decoder, cfg, sampling = ctx.lm, ctx.decoder, ctx.cfg, ctx.sampling
    rows = [prepare(lm.tokenizer, prompt, 0, [], ctx.rendering, lm.max_context)
            for prompt, _ in units[:cfg.gen.batch_size]]
    rows = [ids for _, ids, unfit in rows if not unfit]
    if not rows:
        return
    ids = rows[0]
    with kept_as_is(decoder, lm):  # a hot table must not hold the first prompt's continuation
        for row in rows:
            foresee(decoder, lm, row, min(16, budget(ctx, row)), lm.stop_ids)
        if cfg.gen.batch_size > 1:
            decode_batch(decoder, lm, rows, [min(16, budget(ctx, r)) for r in rows], [sampling] * len(rows),
                         lm.stop_ids)
        else:
            decoder.generate(lm, ids, min(16, budget(ctx, ids)), sampling, lm.stop_ids)
    if cfg.check_lossless:
        autoregressive_decode(lm, ids, min(16, budget(ctx, ids)), Sampling(), lm.stop_ids)


def calibration_candidates(dataset, scored: list) -> tuple[list, bool]:
    """Prompts a self-tuning decoder may calibrate on: the dataset's prompts that are not scored,
    in dataset order (those past dataset.limit), so that no tuning sees a prompt it is scored on.
    When every prompt is scored there are none: the scored ones are used and flagged (True)."""
    scored_ids = {p.id for p in scored}
    everything = dataclasses.replace(dataset, limit=None).load() if getattr(dataset, "limit", None) else scored
    rest = [p for p in everything if p.id not in scored_ids]
    return (rest, False) if rest else (list(scored), True)


def load_addons(decoder, lm) -> None:
    """The decoder's drafts, heads or n-gram tables for `lm`: a bad one fails here, in one line."""
    if isinstance(decoder, LoadsAddOns):
        try:
            with torch.inference_mode():
                decoder.load_addons(lm)
        except (ValueError, FileNotFoundError) as e:
            message = str(e)  # heads and n-gram files name their own decoder.* key
            raise BenchError(message if message.startswith("decoder.") else f"draft: {message}") from None


def prepare_decoder(ctx: RunContext, scored: list) -> dict | None:
    """Before any timing: draft models are built (a bad draft fails here, in one line), and
    decoders that tune themselves to the device (e.g. lookahead with W/N/G = auto) get prompts
    that are not scored to calibrate on. Returns what records say about the calibration, if any."""
    lm, decoder, cfg = ctx.lm, ctx.decoder, ctx.cfg
    load_addons(decoder, lm)  # where not yet: each decoder keeps its add-ons per target
    wanted = decoder.calibration_prompts if isinstance(decoder, SelfTuning) else 0
    if not wanted:
        return None
    candidates, overlaps = calibration_candidates(ctx.dataset, scored)
    if overlaps:
        print(f"[bench] warning: every prompt of {cfg.dataset.name} is scored, so {cfg.decoder.name} calibrates on "
              f"scored prompts; set dataset.limit to leave some out", file=sys.stderr, flush=True)
    prompts, ids = [], []
    for prompt in candidates:
        _, tokens, unfit = prepare(lm.tokenizer, prompt, 0, [], ctx.rendering, lm.max_context)
        if not unfit:
            prompts.append(tokens)
            ids.append(prompt.id)
        if len(prompts) == wanted:
            break
    sampling = sampling_from(cfg)  # calibrate at the run's own settings: acceptance at T > 0 is not greedy's
    with finite_logits(ctx, f"decoder {decoder.name}'s calibration"):
        decoder.prepare(lm, prompts, lm.stop_ids, sampling)
    return {"prompt_ids": ids, "overlaps_scored": overlaps,
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}}


def keep_reference_step(run_dir: Path, reference_step: dict) -> None:
    """provenance.json keeps the speed check (`reference_step`); a drift beyond its bound is said."""
    path = run_dir / "provenance.json"
    rundir.write_atomic(path, json.dumps({**json.loads(path.read_text()), "reference_step": reference_step},
                                         indent=2))
    drift.warn(reference_step, "the run's timed prompts")


def _generate_all(ctx: RunContext, units, log: RecordLog, logger) -> dict:
    """Every unit not yet in the log, generated and appended; returns how the target's one-token
    step before the timed prompts compares with the one after them, and how the autoregressive
    reference's own step moved between them (bench/drift.py)."""
    cfg = ctx.cfg
    with torch.inference_mode():
        scored = [p for p, turn in units if turn == 0]
        calibration = prepare_decoder(ctx, scored)  # before the bar: errors stay one line
    done = sum(f"{p.id}#{t}" in log for p, t in units)
    bar = tqdm(total=len(units), initial=done, unit="prompt", disable=not cfg.progress, dynamic_ncols=True,
               desc=f"{cfg.decoder.name} | {cfg.dataset.name}")
    pace = Pace()
    try:  # closed before any message after it (Ctrl-C's resume hint must come last)
        with torch.inference_mode():
            if cfg.warmup:
                warmup(ctx, units)
            start_ms = drift.step_ms(ctx.lm)  # the machine's speed before the timed prompts, and after
            reference_ms = []  # and the autoregressive reference's own step on each (check_lossless)
            for group in _groups(units, log, cfg.gen.batch_size):
                slurm.raise_if_stopped()  # a SIGTERM whose own raise was lost stops the run here
                ready, records = [], []
                for prompt, turn in group:
                    skipped = skipped_turn(cfg, prompt, turn, [log.get(f"{prompt.id}#{t}") for t in range(turn)])
                    if skipped:
                        records.append(skipped)
                    else:
                        ready.append((prompt, turn))
                if cfg.gen.batch_size > 1:
                    records += run_batch(ctx, ready, log) if ready else []
                else:
                    records += [run_unit(ctx, prompt, turn, [log.get(f"{prompt.id}#{t}")["text"] for t in range(turn)])
                                for prompt, turn in ready]
                for record in records:
                    if calibration is not None:
                        record["calibration"] = calibration
                    log.append(record)
                    if record.get("reference"):
                        reference_ms.append(drift.prompt_step_ms(record["reference"]))
                    if logger is not None:
                        logger.log_record(record)
                    if record["status"] == "ok":
                        bar.set_postfix(**pace.add(record), refresh=False)
                    bar.update(1)
            reference_step = drift.compare(start_ms, drift.step_ms(ctx.lm))
            reference_step["during"] = drift.spread(reference_ms)
    finally:
        bar.close()
    return reference_step
