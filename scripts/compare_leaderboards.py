"""Did a change alter what runs compute? Two leaderboard directories over the same prompts
(before and after): per (dataset, decoder) of the first, how many prompts have identical tokens,
step counts, per-step acceptance (tokens committed, fed, drafted, drafts accepted), the whole
trace with its info, and the same auto-tuned choice. Prints a markdown table; exit 1 if any differ.

    python scripts/compare_leaderboards.py BEFORE_DIR AFTER_DIR
"""
import json
import sys
from pathlib import Path

before, after = Path(sys.argv[1]), Path(sys.argv[2])
FIELDS = ("accepted", "forward_tokens", "draft_tokens", "accepted_draft_tokens", "draft_forward_tokens", "info")


def load(path):
    out = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("status") == "ok":
            out[r["key"]] = r
    return out


rows, all_same = [], True
for run in sorted(before.glob("*/*/records.jsonl")):
    ds, label = run.parent.parent.name, run.parent.name
    other = after / ds / label / "records.jsonl"
    if not other.exists():
        rows.append((ds, label, "missing after", "", "", "", ""))
        all_same = False
        continue
    a, b = load(run), load(other)
    keys = sorted(set(a) & set(b))
    same_tokens = sum(a[k]["tokens"] == b[k]["tokens"] for k in keys)
    same_steps = sum(a[k]["steps"] == b[k]["steps"] for k in keys)
    same_accept = sum(all(a[k]["trace"].get(f) == b[k]["trace"].get(f) for f in FIELDS[:4]) for k in keys)
    same_trace = sum(all(a[k]["trace"].get(f) == b[k]["trace"].get(f) for f in FIELDS) for k in keys)
    same_tuned = all(a[k].get("tuned") == b[k].get("tuned") for k in keys)
    ok = len(keys) == same_tokens == same_steps == same_accept == same_trace and same_tuned
    all_same &= ok
    rows.append((ds, label, len(keys), same_tokens, same_steps, same_accept, same_trace, "yes" if same_tuned else "NO"))
print("| dataset | decoder | prompts | identical tokens | identical steps | identical per-step acceptance | identical trace (+ info) | same tuning |")
print("|:--|:--|--:|--:|--:|--:|--:|:--|")
for r in rows:
    print("| " + " | ".join(map(str, r)) + " |")
print(f"\nall identical: {all_same}")
sys.exit(0 if all_same else 1)
