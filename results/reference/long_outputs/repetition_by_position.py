"""How much of an output repeats itself, by position: the share of tokens whose n-gram (the token
and the n-1 before it) already occurred earlier in the same output.

    python results/reference/long_outputs/repetition_by_position.py RUN_DIR [--ngram 4] [--bin 64] [--out FILE]

RUN_DIR is any run directory (records.jsonl, or a reference run's records.jsonl.gz), e.g. a
leaderboard's autoregressive entry. Beside the leaderboard's accepted_by_output_position.csv it
says why n-gram methods (prompt lookup, lookahead, token recycling) accept more late in a long
answer: the answer has started repeating itself, and their pools copy it. Positions are binned as
there (the bin holding the token's position). Writes a CSV (default
RUN_DIR/repetition_by_position.csv) and prints it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from bench.records import read_records, records_path


def repeated(tokens: list[int], n: int) -> list[bool]:
    """Per token: whether the n-gram ending at it occurred earlier in `tokens` (False for the first n-1)."""
    seen, out = set(), []
    for i in range(len(tokens)):
        gram = tuple(tokens[i - n + 1:i + 1]) if i >= n - 1 else None
        out.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return out


def repetition_table(records, n: int, bin_tokens: int) -> pd.DataFrame:
    rows = [{"position": i // bin_tokens * bin_tokens, "repeated": flag}
            for r in records if r.get("status") == "ok" for i, flag in enumerate(repeated(r["tokens"], n))]
    if not rows:
        return pd.DataFrame(columns=["position", "tokens", "repeated_share"])
    table = pd.DataFrame(rows).groupby("position")["repeated"].agg(["size", "mean"]).reset_index()
    return table.rename(columns={"size": "tokens", "mean": "repeated_share"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--ngram", type=int, default=4, help="n of the n-grams compared (default 4)")
    parser.add_argument("--bin", type=int, default=64, help="output positions per bin (default 64)")
    parser.add_argument("--out", type=Path, help="CSV to write (default RUN_DIR/repetition_by_position.csv)")
    args = parser.parse_args(argv)
    if args.ngram < 1 or args.bin < 1:
        parser.error("--ngram and --bin must be >= 1")
    path = records_path(args.run_dir)
    if not path.is_file():
        print(f"error: no records.jsonl in {args.run_dir}", file=sys.stderr)
        sys.exit(2)
    table = repetition_table(read_records(path), args.ngram, args.bin)
    out = args.out or args.run_dir / "repetition_by_position.csv"
    table.to_csv(out, index=False)
    print(table.to_markdown(index=False, floatfmt=".3f"))


if __name__ == "__main__":
    main()
