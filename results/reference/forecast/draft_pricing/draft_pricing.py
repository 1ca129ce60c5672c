"""A draft's price four ways, on leaderboard runs, against the draft time those runs measured
(measured_draft_ms: per decoding step) and with the speedup each forecast gives:
- before: every depth at the first-depth curve (profile.csv alone), as many depths as the tree kept
  (draft_depth): how bench.forecast priced a draft before 1a5ad59;
- later: the first depth at profile.csv, the later ones at profile_later.csv;
- host: and step.csv's host work on every depth;
- now: and as many depths as the step drafted (draft_forwards, recorded since ea1f5a7), which is
  what bench.forecast does.

    python results/reference/forecast/draft_pricing/draft_pricing.py PROFILE OUT BOARD [BOARD ...]
PROFILE is scripts/profile_device.py's --out with scripts/profile_draft.py's draft-<label>/ in it;
each BOARD a leaderboard directory. Writes OUT/draft_pricing.csv and OUT/draft_pricing.md.
"""
import copy
import shutil
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from bench import forecast as fc  # noqa: E402

PRICINGS = {  # name -> (draft profile files left out, whether draft_forwards is read)
    "before": (("profile_later.csv", "step.csv"), False),
    "later": (("step.csv",), False),
    "host": ((), False),
    "now": ((), True),
}


def kept_depth_only(runs: list) -> list:
    """The runs as if no step had recorded draft_forwards."""
    runs = copy.deepcopy(runs)
    for run in runs:
        for r in run.records:
            for info in r["trace"].get("info") or []:
                if isinstance(info, dict):
                    info.pop("draft_forwards", None)
    return runs


def priced(profile: Path, boards: list[Path]) -> pd.DataFrame:
    rows = []
    loaded = {board: fc.find_runs(board) for board in boards}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (dropped, forwards) in PRICINGS.items():
            copied = Path(tmp) / name
            shutil.copytree(profile, copied)
            for f in dropped:
                for p in copied.glob(f"draft-*/{f}"):
                    p.unlink()
            prof = fc.load_profile(copied)
            for runs in loaded.values():
                table = fc.forecast(runs if forwards else kept_depth_only(runs), prof)
                for _, r in table[table["draft_source"].str.startswith("profile draft-")].iterrows():
                    rows.append({"dataset": r["dataset"], "entry": r["run"], "pricing": name,
                                 "measured_draft_ms": r["measured_draft_ms"], "draft_ms": r["draft_ms"],
                                 "measured_speedup": r["measured_speedup"], "forecast_speedup": r["forecast_speedup"]})
    t = pd.DataFrame(rows)
    t["draft_error"] = t["draft_ms"] / t["measured_draft_ms"] - 1
    t["speedup_error"] = t["forecast_speedup"] / t["measured_speedup"] - 1
    return t


def main() -> None:
    profile, out, boards = Path(sys.argv[1]), Path(sys.argv[2]), [Path(b) for b in sys.argv[3:]]
    t = priced(profile, boards)
    out.mkdir(parents=True, exist_ok=True)
    t.to_csv(out / "draft_pricing.csv", index=False)
    keys = ["dataset", "entry"]
    wide = t.pivot_table(index=keys, columns="pricing", values="draft_ms")[list(PRICINGS)]
    wide.columns = [f"draft_ms {p}" for p in wide.columns]
    errors = t.pivot_table(index=keys, columns="pricing", values="speedup_error")[["before", "now"]]
    errors.columns = [f"speedup error {p}" for p in errors.columns]
    first = t[t["pricing"] == "before"].set_index(keys)
    wide = pd.concat([first[["measured_draft_ms"]], wide, first[["measured_speedup"]], errors], axis=1)
    summary = t.groupby("pricing", sort=False).agg(
        draft_mean_abs_error=("draft_error", lambda e: e.abs().mean()),
        draft_worst=("draft_error", lambda e: e.loc[e.abs().idxmax()]),
        speedup_mean_abs_error=("speedup_error", lambda e: e.abs().mean()),
        speedup_worst=("speedup_error", lambda e: e.loc[e.abs().idxmax()]),
        speedup_within_10pct=("speedup_error", lambda e: f"{(e.abs() <= 0.1).sum()} of {len(e)}"))
    md = (f"Draft prices of {', '.join(map(str, boards))} at {profile}\n\n"
          + wide.reset_index().to_markdown(index=False, floatfmt=".3g") + "\n\n"
          + summary.reset_index().to_markdown(index=False, floatfmt="+.1%") + "\n")
    (out / "draft_pricing.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
