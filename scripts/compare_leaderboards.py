"""Did a change alter what runs compute? Two leaderboard directories over the same prompts
(before and after): per (dataset, decoder) of either, how many prompts have identical tokens,
step counts, per-step acceptance (tokens committed, fed, drafted, drafts accepted), the whole
trace with its info, and the same auto-tuned choice; and which prompts one side has and the other
lacks (a run or a prompt missing on either side is a difference). Prints a markdown table; exit 1
if anything differs, 2 for bad input (a path that is not a leaderboard directory).

    python scripts/compare_leaderboards.py BEFORE_DIR AFTER_DIR
"""
import sys
from pathlib import Path

from bench.errors import BenchError, fail
from bench.records import iter_records, records_path, run_dirs
from bench.usage import Parser

FIELDS = ("committed", "forward_tokens", "draft_tokens", "accepted_draft_tokens", "draft_forward_tokens", "info")
USAGE = "give two leaderboard out_dirs: python scripts/compare_leaderboards.py BEFORE_DIR AFTER_DIR"


def runs(root: Path) -> dict[tuple[str, str], Path]:
    """(dataset, decoder label) -> records.jsonl (or .jsonl.gz), laid out as the leaderboard writes them."""
    if not root.is_dir():
        raise BenchError(f"{root} is not a directory; {USAGE}")
    found = {(run.parent.name, run.name): records_path(run) for run in run_dirs(root, "*/*")}
    if not found:
        raise BenchError(f"{root} holds no <dataset>/<decoder>/records.jsonl: not a leaderboard out_dir")
    return found


def load(path: Path) -> dict[str, dict]:
    """The finished records of a run, by key (invalid lines skipped, with a warning)."""
    return {r["key"]: r for r in iter_records(path) if r["status"] == "ok"}


def compare(a: dict, b: dict) -> tuple[tuple, bool]:
    keys = sorted(set(a) & set(b))
    same_tokens = sum(a[k]["tokens"] == b[k]["tokens"] for k in keys)
    same_steps = sum(a[k]["steps"] == b[k]["steps"] for k in keys)
    same_accept = sum(all(a[k]["trace"].get(f) == b[k]["trace"].get(f) for f in FIELDS[:4]) for k in keys)
    same_trace = sum(all(a[k]["trace"].get(f) == b[k]["trace"].get(f) for f in FIELDS) for k in keys)
    same_tuned = all(a[k].get("tuned") == b[k].get("tuned") for k in keys)
    only_before, only_after = len(set(a) - set(b)), len(set(b) - set(a))
    unmatched = ", ".join(f"{n} only {side}" for n, side in ((only_before, "before"), (only_after, "after")) if n)
    ok = (len(keys) == same_tokens == same_steps == same_accept == same_trace and same_tuned and not unmatched)
    return (len(keys), same_tokens, same_steps, same_accept, same_trace, "yes" if same_tuned else "NO",
            unmatched or "none"), ok


def main(argv: list[str]) -> int:
    parser = Parser(__doc__, prog="python scripts/compare_leaderboards.py")
    parser.add_argument("before", type=Path, metavar="BEFORE_DIR", help="a leaderboard out_dir (the reference)")
    parser.add_argument("after", type=Path, metavar="AFTER_DIR", help="a leaderboard out_dir over the same prompts")
    args = parser.parse_args(argv)
    before, after = runs(args.before), runs(args.after)
    rows, all_same = [], True
    for ds, label in sorted(set(before) | set(after)):
        if (ds, label) not in after or (ds, label) not in before:
            rows.append((ds, label, f"missing {'after' if (ds, label) not in after else 'before'}",
                         "", "", "", "", "", ""))
            all_same = False
            continue
        row, ok = compare(load(before[ds, label]), load(after[ds, label]))
        rows.append((ds, label, *row))
        all_same &= ok
    print("| dataset | decoder | prompts | identical tokens | identical steps | identical per-step acceptance | "
          "identical trace (+ info) | same tuning | prompts on one side only |")
    print("|:--|:--|--:|--:|--:|--:|--:|:--|:--|")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")
    print(f"\nall identical: {all_same}")
    return 0 if all_same else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BenchError as e:
        fail(e)
