"""`python -m bench.leaderboard [+preset=NAME] [overrides]`: every decoder on the same prompts of
every dataset, side by side, into one Spec-Bench-style table (conf/leaderboard.yaml).

Per dataset the model is loaded once and every decoder built once; each prompt is then run by
every decoder in a rotating order (no method always runs first), `leaderboard.repeats` times
(default 1), so ratios compare runs made in the same process under the same conditions. Each
(dataset, decoder) is an ordinary run directory (out_dir/<dataset>/<label>/: config.yaml,
records.jsonl, summary.csv), so `python -m bench.show` and `python -m bench.report` read them,
and a rerun with the same out_dir resumes: finished records are skipped, none is duplicated.
Settings are checked, one line and exit code 2 for a bad one, before torch is imported (here and
bench/settings.py); bench/leaderboard_run.py runs the entries, bench/leaderboard_tables.py tables them.
With hydra/launcher=<slurm, slurm_cpu, joblib, ...> the board runs as units (entries x a slice of
questions), a job each beside its own autoregressive reference, merged into the same tables
(bench/leaderboard_cluster.py); --dry-run prints the plan (units, expected tokens, forwards, time).

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
- vllm_mean_acceptance_length, vllm_acceptance_by_position, sglang_accept_length, eagle_tau: acceptance
  as vLLM, SGLang and EAGLE's evaluation count it (bench/metrics.py; docs/acceptance.md),
- tokens_per_s: new tokens / seconds, summed over timed runs,
- speedup (Spec-Bench's), speedup_geomean, speedup_pooled: bench/metrics.py defines them, over
  every timed run, each repeat against the reference's same repeat,
- speedup_per_run_median / _p25 / _p75: the spread of the per-run ratio (bench/metrics.py),
- speedup_ci_low / _high, tokens_per_s_ci_low / _high: 95% bootstrap intervals over prompts and their
  repeats (bench/metrics.py); vs_autoregressive: faster or slower where the speedup's interval is
  above or below 1, else indistinct; overlaps: the entries (of the same dataset) whose speedup
  intervals overlap this one's, which the table does not order,
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

import re
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from . import registry, rundir
from .__main__ import CONF_DIR, GROUPS, check_writable, config_choices, error_reason
from .errors import BenchError
from .registry import REFERENCE
from .settings import check_seed, check_settings
from .usage import asks_help, config_block, stop_if_parse_only

TURNS = ("first", "all")  # leaderboard.turns: a conversation's first turn only, or every turn (Spec-Bench's)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if asks_help(args):  # overrides are Hydra's; these two are the manual, then the options
        print(f"{__doc__.strip()}\n\nOptions (key=value, beside any of python -m bench --help), "
              f"conf/leaderboard.yaml:\n\n{config_block(CONF_DIR / 'leaderboard.yaml', 'leaderboard')}")
        return
    dry_run, overrides = "--dry-run" in args, [a for a in args if a != "--dry-run"]
    try:
        base, labels, runs = compose_all(overrides)
        launcher = launcher_choice(overrides)
        if dry_run or launcher:  # bench/leaderboard_cluster.py: the board as units, a job each
            from .leaderboard_cluster import Unfinished, run_cluster

            stop_if_parse_only()
            try:
                print(run_cluster(base, labels, runs, overrides, launcher, dry_run))
            except Unfinished as e:
                print(f"\n{e}", file=sys.stderr)
                sys.exit(1)
            return
        check_directories(base, runs)
        stop_if_parse_only()
        # Torch and the decoders, seconds to import, only once every setting that needs neither passed.
        from .leaderboard_run import run_board

        print(run_board(base, labels, runs, overrides))
    except BenchError as e:
        print(f"error: {' '.join(error_reason(e).split())}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # every finished record is on disk; the same command resumes
        print("\ninterrupted: the finished records are kept; rerun the same command to go on", file=sys.stderr)
        sys.exit(130)


def launcher_choice(overrides: list[str]) -> str | None:
    """The Hydra launcher the command line names (hydra/launcher=<name>: the board then runs as units), or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(overrides):
        if override.get_key_element().lstrip("+~") == "hydra/launcher":
            return override.get_value_element_as_str()
    return None


def compose_all(overrides: list[str]):
    """The leaderboard config, the labels to run, and per (dataset, label) the full run config;
    what needs nothing but the config is checked (bench/settings.py), nothing imports torch."""
    precheck(overrides)
    methods = registry.store_leaderboard_entries(registry.searchpath_dirs(overrides))  # each method's default entry
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            base = compose("leaderboard", overrides=overrides)
        except Exception as e:  # an unknown key, a bad value: Hydra's reason, in one line
            raise BenchError(f"{' '.join(overrides)}: {error_reason(e)}") from None
        check_seed(base.seed)
        labels = check_board(base, methods)
        entries = with_drafts(base.leaderboard, base.model, labels)
        base.leaderboard.decoders = entries  # what ran, as it ran: leaderboard.yaml and each config.yaml keep these
        runs = compose_entries(overrides, base.leaderboard, entries, labels)
    return base, labels, runs


def check_board(base, methods: list[str]) -> list[str]:
    """The labels to run, in table order (leaderboard.decoders is put in that order too); one line
    for a leaderboard setting it cannot run with."""
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
    datasets = OmegaConf.to_container(board.datasets) if OmegaConf.is_config(board.datasets) else board.datasets
    if not (isinstance(datasets, list) and datasets and all(isinstance(d, str) for d in datasets)):
        raise BenchError(f"leaderboard.datasets must be a non-empty list of datasets (of "
                         f"{', '.join(config_choices('dataset'))}), got {datasets!r}")
    if not (isinstance(board.limit, int) and board.limit >= 1):
        raise BenchError(f"leaderboard.limit must be an integer >= 1, got {board.limit!r}")
    if isinstance(board.repeats, bool) or not (isinstance(board.repeats, int) and board.repeats >= 1):
        raise BenchError(f"leaderboard.repeats must be an integer >= 1, got {board.repeats!r}")
    if board.get("turns", "first") not in TURNS:
        raise BenchError(f"leaderboard.turns must be one of {', '.join(TURNS)}, got {board.turns!r}")
    return labels


def compose_entries(overrides: list[str], board, entries: dict[str, list[str]], labels: list[str]) -> dict:
    """Per (dataset, label): that entry's run config on that dataset (`entries`: label -> its
    overrides), its own settings checked. A compose is Hydra's slowest step (a quarter of a second
    on a slow CPU): an entry is composed on the first dataset and takes each other dataset's node,
    composed once per dataset, unless its overrides name dataset keys (then it is composed on each).
    tests/test_leaderboard.py checks the two ways give the same configs."""
    def composed(what: str, extra: list[str]):
        try:
            return compose("leaderboard", overrides=[*overrides, f"dataset.limit={board.limit}", *extra])
        except Exception as e:  # Hydra's own errors: one line naming the entry
            raise BenchError(f"{what}: {error_reason(e)}") from None

    first, *others = list(board.datasets)
    nodes = {ds: composed(f"leaderboard dataset {ds}", [f"dataset={ds}"]).dataset for ds in others}
    runs = {}
    for label in labels:
        own = composed(f"leaderboard entry {label} on {first}", [f"dataset={first}", *entries[label]])
        for ds in board.datasets:
            if ds == first:
                cfg = own
            elif names_dataset(entries[label]):
                cfg = composed(f"leaderboard entry {label} on {ds}", [f"dataset={ds}", *entries[label]])
            else:
                cfg = own.copy()
                cfg.dataset = nodes[ds].copy()
            cfg.leaderboard.decoders = entries
            check_settings(cfg)
            runs[ds, label] = cfg
    return {(ds, label): runs[ds, label] for ds in board.datasets for label in labels}


def names_dataset(entry: list[str]) -> bool:
    """Whether an entry's overrides set the dataset group or any of its keys."""
    return any(re.match(r"[+~]*dataset\b", o) for o in entry)


def check_directories(base, runs: dict) -> None:
    """leaderboard.out_dir a new or empty directory or a leaderboard's own, and writable; every
    entry's run directory resumable with its settings. Writes nothing."""
    out_dir = Path(base.leaderboard.out_dir)
    rundir.check_board_dir(out_dir)  # only a new or empty directory, or a leaderboard's own
    if (out_dir / "units").is_dir():
        raise BenchError(f"leaderboard.out_dir={out_dir} holds a sharded leaderboard (units/): resume it with the "
                         "command that planned it (its hydra/launcher=...), or choose a new leaderboard.out_dir")
    check_writable("leaderboard.out_dir", base.leaderboard.out_dir)  # one line and exit 2, as for hydra.run.dir
    for (ds, label), cfg in runs.items():  # every entry before any runs: a refusal changes nothing
        # the leaderboard's own keys and the prompt count may change: raising the limit extends a run
        rundir.check_resume(out_dir / ds / label, cfg, True, "leaderboard.out_dir",
                            ignore=("leaderboard", "dataset.limit"))


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


if __name__ == "__main__":
    main()
