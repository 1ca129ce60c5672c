"""`python -m bench.replot DIR... [--out DIR]`: a leaderboard's plots drawn again from its records, as the
leaderboard draws them (bench/leaderboard_plots.py): after the plotting code changed, or for a checked-in
reference. The table the plots read is made again from the records (bench/leaderboard_tables.py, nothing
else is rewritten); the datasets and entries, in the table's order, come from DIR/leaderboard.csv, the
sweeps from DIR/leaderboard.yaml (where they still exist), and the titles' model, device and dtype from
DIR/provenance.json and the records. Writes DIR/plots/ (or OUT/plots/)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from .errors import BenchError, fail
from .leaderboard_plots import plot_all
from .leaderboard_tables import table
from .plotting import setup
from .records import read_records, records_path
from .registry import REFERENCE
from .usage import Parser


def replot(board: Path, out: Path | None = None) -> Path:
    """The plots of the leaderboard at `board`, into out/plots (default board/plots); returns that folder."""
    if not (board / "leaderboard.csv").is_file():
        raise BenchError(f"{board}: no leaderboard.csv; give a leaderboard's out_dir")
    written = pd.read_csv(board / "leaderboard.csv")
    datasets = [d for d in dict.fromkeys(written["dataset"]) if d != "all"]
    labels = list(dict.fromkeys(written["decoder"]))
    records = {(ds, label): read_records(records_path(board / ds / label)) if (board / ds / label).is_dir() else []
               for ds in datasets for label in labels}
    if not any(records[ds, REFERENCE] for ds in datasets):
        raise BenchError(f"{board}: no {REFERENCE} records; every speedup is against them")
    config = OmegaConf.load(board / "leaderboard.yaml") if (board / "leaderboard.yaml").is_file() else None
    sweeps = [s for s in (OmegaConf.select(config, "leaderboard.sweeps") or [] if config else []) if Path(s).exists()]
    provenance = json.loads((board / "provenance.json").read_text()) if (board / "provenance.json").is_file() else {}
    model = (OmegaConf.select(config, "model.name") if config else None) or next(
        (r.get("model") for recs in records.values() for r in recs if r.get("model")), None)
    return plot_all(out or board, datasets, labels, table(records, datasets, labels), sweeps, records,
                    where=setup(provenance, model))


def main(argv: list[str] | None = None) -> None:
    parser = Parser(__doc__, prog="python -m bench.replot")
    parser.add_argument("boards", nargs="+", type=Path, metavar="DIR", help="leaderboard out_dirs")
    parser.add_argument("--out", type=Path, help="a folder to write plots/ into (one DIR only; default DIR)")
    args = parser.parse_args(argv)
    if args.out is not None and len(args.boards) > 1:
        parser.error("--out takes one DIR")
    try:
        for board in args.boards:
            print(replot(board, args.out))
    except BenchError as e:
        fail(e)


if __name__ == "__main__":
    main(sys.argv[1:])
