"""The draft's price three ways, on runs of prompts no leaderboard scores, against the draft time
those runs measured: each step's depths all at the first-depth curve (profile.csv alone: how
bench.forecast priced a draft before 1a5ad59), the first depth at profile.csv and the later ones at
profile_later.csv, and both plus step.csv's host work per depth (what bench.forecast does now).

    python results/reference/forecast/draft_pricing/draft_pricing.py RUNS PROFILE OUT
RUNS holds one leaderboard directory per dataset; PROFILE is scripts/profile_device.py's --out with
scripts/profile_draft.py's draft-<label>/ beside it. Writes OUT/draft_pricing.csv and .md.
"""
import shutil
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from bench import forecast as fc  # noqa: E402

PRICINGS = {"first_only": ("profile_later.csv", "step.csv"), "first_later": ("step.csv",), "first_later_host": ()}


def priced(runs_dir: Path, profile: Path) -> pd.DataFrame:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, dropped in PRICINGS.items():
            copy = Path(tmp) / name
            shutil.copytree(profile, copy)
            for f in dropped:
                for p in copy.glob(f"draft-*/{f}"):
                    p.unlink()
            prof = fc.load_profile(copy)
            for board in sorted(d for d in runs_dir.iterdir() if d.is_dir() and d.name != profile.name):
                table = fc.forecast(fc.find_runs(board), prof)
                for _, r in table[table["decoder"] != "autoregressive"].iterrows():
                    rows.append({"dataset": r["dataset"], "entry": r["run"], "pricing": name,
                                 "measured_draft_ms": r["measured_draft_ms"], "draft_ms": r["draft_ms"],
                                 "measured_speedup": r["measured_speedup"], "forecast_speedup": r["forecast_speedup"]})
    t = pd.DataFrame(rows)
    t["draft_error"] = t["draft_ms"] / t["measured_draft_ms"] - 1
    t["speedup_error"] = t["forecast_speedup"] / t["measured_speedup"] - 1
    return t


def main() -> None:
    runs_dir, profile, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    t = priced(runs_dir, profile)
    out.mkdir(parents=True, exist_ok=True)
    t.to_csv(out / "draft_pricing.csv", index=False)
    wide = t.pivot_table(index=["dataset", "entry"], columns="pricing", values=["draft_ms", "speedup_error"])
    wide.columns = [f"{v}:{p}" for v, p in wide.columns]
    first = t[t["pricing"] == "first_only"].set_index(["dataset", "entry"])
    wide.insert(0, "measured_draft_ms", first["measured_draft_ms"])
    wide.insert(1, "measured_speedup", first["measured_speedup"])
    summary = t.groupby("pricing")[["draft_error", "speedup_error"]].agg(
        lambda e: f"mean |e| {e.abs().mean():.1%}, worst {e.loc[e.abs().idxmax()]:+.1%}")
    md = wide.reset_index().to_markdown(index=False, floatfmt=".3g") + "\n\n" + summary.to_markdown() + "\n"
    (out / "draft_pricing.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
