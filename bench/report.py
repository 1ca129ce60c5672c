"""`python -m bench.report DIR... [--out DIR]`: one table across runs.

Finds every run directory (one holding records.jsonl, or a reference run's records.jsonl.gz)
under the given paths, recomputes each summary from its records with bench.metrics, and prints
one Markdown table; with --out also writes report.csv and report.md there. Sweep parameters
that differ between runs are added as columns (from each run's config.yaml).

Records are read one at a time (bench.records.iter_records: invalid lines, and records that
are not the run's by the rule resume applies, skipped with a warning) into the columns a summary
uses; tokens, text and per-step traces are never kept, so memory grows by under a kilobyte a record
at its peak, not with the records' size (1M records, a 1.66 GB file: 1.2 GB peak RSS, 0.3 GB of it
imports). Bad input (a missing path, no runs, no
valid records, an unwritable --out, an --out holding anything but a report) ends in one line and
exit code 2.
"""
from __future__ import annotations

import json
import math
import re
import sys
from array import array
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from . import metrics, rundir
from .errors import BenchError, fail
from .records import GZIPPED, RECORDS, iter_records, records_path, run_dirs
from .usage import Parser

# What bench.metrics.summarize reads of a record. While streaming, numbers go into float64 arrays
# (8 bytes a record each) and the rest into lists of shared objects; tokens, text and traces, the
# bulk of a record, are never kept.
NUMBERS = ("new_tokens", "steps", "latency_s", "ttft_s", "tokens_per_s", "target_time_s", "draft_time_s",
           "overhead_time_s", "forward_tokens", "draft_tokens", "accepted_draft_tokens", "target_flops", "draft_flops",
           "decode_tokens", "decode_steps", "decode_flops", "decode_draft_flops", "hit_steps", "paths", "head_flops",
           "rescore_flops", "quality_score", "draft_steps", "verified_tokens")
OBJECTS = ("decoder", "model", "dataset", "category", "status", "quality_metric", "decoder_lossless", "lossless",
           "divergence_tie", "reference", "tuned", "batch", "depth_proposed", "depth_accepted", "prompt_id",
           "accepted_at_least")


def _natural(path: Path) -> list:
    # Numbers compare as numbers, so a sweep's rows go decoder.window=3 before decoder.window=10.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def find_runs(paths: list[str]) -> list[Path]:
    runs = []
    for p in map(Path, paths):
        if not p.exists():
            raise BenchError(f"{p} does not exist; give run or sweep directories written by python -m bench")
        if p.is_file():
            p = p.parent if p.name in (RECORDS, GZIPPED) else p
        runs += sorted(run_dirs(p), key=_natural)
    return list(dict.fromkeys(runs))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def columns(records) -> pd.DataFrame:
    """One row per record, built column by column from an iterable of records."""
    numbers = {k: array("d") for k in NUMBERS}
    objects: dict[str, list] = {k: [] for k in OBJECTS}
    present: set[str] = set()  # a column only where some record has the field, as pd.DataFrame(records) does
    for record in records:
        record = {**record, **metrics.acceptance_counts(record)}  # an older record's, from its trace
        present.update(k for k in record if k not in present)
        for k, column in numbers.items():
            value = record.get(k)
            column.append(math.nan if value is None else value)
        for k, column in objects.items():
            value = record.get(k)
            column.append(sys.intern(value) if isinstance(value, str) else value)
    table = {**{k: np.frombuffer(v, dtype=np.float64) if len(v) else np.zeros(0) for k, v in numbers.items()},
             **objects}
    return pd.DataFrame({k: v for k, v in table.items() if k in present})


def load_run(run: Path, by_category: bool = False) -> tuple[pd.DataFrame, dict]:
    # damaged or invalid lines, second copies of a key and records that are not the run's (another
    # decoder's, a prompt of other text: rundir.record_rule, as resume has it) are skipped, with a warning
    records = columns(iter_records(records_path(run), **rundir.record_rule(run)))
    config = run / "config.yaml"
    try:
        params = _flat(OmegaConf.to_container(OmegaConf.load(config))) if config.is_file() else {}
    except Exception as e:  # unparsable YAML, unreadable file: its parameters are unknown, its records still count
        print(f"warning: {config} is not readable YAML ({type(e).__name__}): its sweep parameters are left out",
              file=sys.stderr)
        params = {}
    return metrics.summarize(records, by_category=by_category), params


def report(paths: list[str], by_category: bool = False) -> tuple[pd.DataFrame, list[str]]:
    runs = find_runs(paths)
    if not runs:
        raise BenchError(f"no run directories (with records.jsonl) under {' '.join(paths)}; give run or sweep "
                         "directories written by python -m bench")
    loaded = [(run, *load_run(run, by_category)) for run in runs]
    empty = [str(run) for run, summary, _ in loaded if summary.empty]
    if empty:  # a run that failed or was killed before its first record
        print(f"warning: no finished records in {', '.join(empty)}: left out", file=sys.stderr)
    loaded = [x for x in loaded if not x[1].empty]
    if not loaded:
        raise BenchError(f"no valid records under {' '.join(paths)}: every run is empty or damaged")
    # Config keys that vary across runs are the sweep's parameters: show them.
    keys = sorted({k for _, _, p in loaded for k in p})
    varying = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for _, _, p in loaded}) > 1
               and not k.startswith(("data_dir", "cache_dir", "resume", "progress"))]
    tables = []
    for run, summary, params in loaded:
        summary = summary.copy()
        for k in varying:
            summary[k] = json.dumps(params.get(k)) if isinstance(params.get(k), (list, dict)) else params.get(k)
        summary["run"] = str(run)
        tables.append(summary)
    return pd.concat(tables, ignore_index=True), varying


def main(argv: list[str] | None = None) -> None:
    parser = Parser(__doc__, prog="python -m bench.report")
    parser.add_argument("paths", nargs="+", help="run or sweep directories")
    parser.add_argument("--out", help="directory for report.csv and report.md")
    parser.add_argument("--by-category", action="store_true",
                        help="a row per prompt category too, where prompts carry one (MT-Bench's eight)")
    args = parser.parse_args(argv)
    try:
        table, varying = report(args.paths, args.by_category)
        shown = [c for c in metrics.DISPLAY[:3] + varying + metrics.DISPLAY[3:] if c in table.columns]
        md = table[shown].to_markdown(index=False, floatfmt=".4g")
        # written before printing: a bad --out fails before any output
        written = rundir.write_report(Path(args.out), "report", table, md) if args.out else []
    except BenchError as e:
        fail(e)
    rundir.print_report(md, written)


if __name__ == "__main__":
    main()
