"""Does the forecast hold on this machine? One leaderboard's runs priced at another setting's device
profile (bench.forecast), against the speedups that setting's own leaderboard measured (here: fp32
records with the bf16 profile, and back).

    python results/reference/forecast/cpu_cross_dtype/forecast_across.py RUNS_DIR --profile PROFILE
        --measured MEASURED_DIR [--path P] [--tolerance 0.10] [--out DIR]

RUNS_DIR and MEASURED_DIR are leaderboard out_dirs over the same prompts (<dataset>/<entry>/records);
PROFILE is what bench.forecast takes (a scripts/profile_device.py --out directory of the measured
setting); its path is the one the measured leaderboard ran (its provenance.json), else --path. Per
(dataset, entry): the forecast speedup, the measured one (MEASURED_DIR/leaderboard.csv), their
relative error and whether it is within the tolerance; and same_output, the share of the priced run's
prompts whose output the measured run's equals token for token (where MEASURED_DIR keeps records), since
where the two settings decoded different text (half-precision ties, a tuner choosing by the device's
timings) the run priced is not the run measured. Writes forecast_across.csv and .md to --out; bad input
ends in one line and exit code 2.
"""
import argparse
import json
from pathlib import Path

import pandas as pd

from bench import rundir
from bench.errors import BenchError, fail
from bench.forecast import Profile, Run, find_runs, forecast, load_profile, pick_path
from bench.records import read_records, records_path


def measured_speedups(directory: Path) -> pd.DataFrame:
    csv = directory / "leaderboard.csv"
    try:
        table = pd.read_csv(csv)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read {csv} ({e}); --measured takes a leaderboard out_dir") from None
    if not {"decoder", "dataset", "speedup"} <= set(table.columns):
        raise BenchError(f"{csv} lacks decoder, dataset or speedup columns: not a leaderboard's table")
    return table[["dataset", "decoder", "speedup", "mean_accepted_tokens"]]


def measured_path(measured: Path, profile: Profile) -> str | None:
    """The profile's path for the fast path and compile the measured leaderboard ran (its provenance.json):
    the setting forecast is the measured one, not the priced run's."""
    try:
        info = json.loads((measured / "provenance.json").read_text())
    except (OSError, ValueError):
        return None
    if profile.roofline is not None or not isinstance(info, dict):
        return None
    return pick_path(profile.curves, info, None, profile.source)


def same_output(priced: Run, measured: Path) -> float:
    """The share of the priced run's prompts whose output the measured run's (its records under
    `measured`, finished ones) equals; NaN where the measured side has none of them."""
    path = records_path(measured)
    theirs = {r["key"]: r["tokens"] for r in read_records(path) if r["status"] == "ok"} if path.is_file() else {}
    shared = [r for r in priced.records if r["key"] in theirs]
    return sum(r["tokens"] == theirs[r["key"]] for r in shared) / len(shared) if shared else float("nan")


def across(runs_dir: Path, profile: Path, measured: Path, path: str | None, tolerance: float) -> pd.DataFrame:
    loaded = load_profile(profile)
    runs = find_runs(runs_dir)
    predicted = forecast(runs, loaded, path or measured_path(measured, loaded))
    # each priced run beside the measured side's run at the same place (<dataset>/<entry>)
    pairs = {(run.records[0].get("dataset"), run.label): (run, measured / run.directory.relative_to(runs_dir))
             for run in runs if run.directory.is_relative_to(runs_dir)}
    predicted["same_output"] = [same_output(*pairs[key]) if key in pairs else float("nan")
                                for key in zip(predicted["dataset"], predicted["run"])]
    predicted = predicted.drop(columns="decoder").rename(columns={"run": "decoder"})[  # the entry label
        ["dataset", "decoder", "forecast_speedup", "mean_accepted_tokens", "same_output", "target_source",
         "draft_source"]]
    table = predicted.merge(measured_speedups(measured), on=["dataset", "decoder"], how="inner",
                            suffixes=("", "_measured"))
    if table.empty:
        raise BenchError(f"no (dataset, entry) of {runs_dir} is in {measured}/leaderboard.csv: "
                         "give two leaderboards over the same entries")
    table = table.rename(columns={"speedup": "measured_speedup"})
    table["error"] = table["forecast_speedup"] / table["measured_speedup"] - 1
    table["within"] = table["error"].abs() <= tolerance
    order = ["dataset", "decoder", "forecast_speedup", "measured_speedup", "error", "within", "mean_accepted_tokens",
             "mean_accepted_tokens_measured", "same_output", "target_source", "draft_source"]
    return table[order].sort_values(["dataset", "decoder"]).reset_index(drop=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", help="the leaderboard whose records are priced")
    parser.add_argument("--profile", required=True, help="the other setting's profile (bench.forecast --profile)")
    parser.add_argument("--measured", required=True, help="the other setting's leaderboard out_dir")
    parser.add_argument("--path", help="the profile's fast path (default: the measured leaderboard's; the "
                                       "hf_* peers take it uncompiled)")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    try:
        table = across(Path(args.runs_dir), Path(args.profile), Path(args.measured), args.path, args.tolerance)
        worst = table.loc[table["error"].abs().idxmax()]
        md = (f"{args.runs_dir} priced at {args.profile}, against {args.measured}: {int(table['within'].sum())} of "
              f"{len(table)} within {args.tolerance:.0%}; largest error {worst['error']:+.1%} "
              f"({worst['decoder']}, {worst['dataset']})\n\n" + table.to_markdown(index=False, floatfmt=".3f"))
        written = rundir.write_report(Path(args.out), "forecast_across", table, md) if args.out else []
    except BenchError as e:
        fail(e)
    rundir.print_report(md, written)


if __name__ == "__main__":
    main()
