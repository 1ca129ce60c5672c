"""What a single run prints when it ends: the method against autoregressive in a few lines
(tokens per step, speedup with both tokens/s, lossless, quality, where the files are). Every
figure comes from bench/metrics.py; summary.md/.csv hold the rest."""
from __future__ import annotations

from pathlib import Path

from . import metrics

# What the ending reads of a record: tokens, texts and traces are not kept while reading.
FIELDS = ("decoder", "model", "dataset", "status", "new_tokens", "steps", "latency_s", "reference", "lossless",
          "first_divergence", "first_real_divergence", "divergence_tie", "quality_metric", "quality_score", "key",
          "decoder_lossless")


def comparison(records, run_dir: Path) -> str:
    """records: the run's records (any iterable; each read once). The method against the
    autoregressive run check_lossless made in the same process, or a line saying there is none."""
    records = [{k: r.get(k) for k in FIELDS} for r in records]
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return f"no prompt ran ({len(records)} skipped: see records.jsonl)\nrun directory: {run_dir}"
    first = ok[0]
    skipped = len(records) - len(ok)
    lines = [f"{first['decoder']}{'' if metrics.decoder_lossless(ok) else ' (a lossy variant)'} vs autoregressive: "
             f"{first['model']}, {first['dataset']}, {len(ok)} prompts" + (f" ({skipped} skipped)" if skipped else "")]
    pairs = [(r, r["reference"]) for r in ok if r["reference"]]
    if pairs:
        speedup = metrics.speedups(pairs)["speedup"]
        ci = metrics.speedup_interval(pairs)
        ref = [b for _, b in pairs]
        lines.append(f"  tokens per step  {metrics.tokens_per_step(ok):.2f} vs {metrics.tokens_per_step(ref):.2f}")
        lines.append(f"  speedup          {speedup:.2f}x (95% CI {ci['speedup_ci_low']:.2f}-{ci['speedup_ci_high']:.2f}"
                     f" over prompts): {metrics.mean_tokens_per_s(a for a, _ in pairs):.1f} vs "
                     f"{metrics.mean_tokens_per_s(ref):.1f} tokens/s (mean per prompt; autoregressive run in this "
                     "process by check_lossless)")
    else:
        lines.append(f"  tokens per step  {metrics.tokens_per_step(ok):.2f} (autoregressive: 1.00)")
        lines.append("  speedup          n/a: no autoregressive run in this process "
                     f"({metrics.pooled_tokens_per_s(ok):.1f} "
                     "tokens/s alone); rerun with check_lossless=true (greedy), or python -m bench.leaderboard")
    lines.append(f"  lossless         {lossless_line(ok)}")
    quality = metrics.quality(ok)
    if quality["quality_metric"] and quality["quality"] == quality["quality"]:
        scored = sum(r["quality_score"] is not None for r in ok)
        lines.append(f"  quality          {quality['quality_metric']} {quality['quality']:.3f} ({scored} scored)")
    lines.append(f"  files            {run_dir}: summary.md (every figure), records.jsonl (per prompt)")
    return "\n".join(lines)


def lossless_line(ok: list[dict]) -> str:
    """n/N identical to autoregressive greedy, and how many of the rest depart at ties only
    (bench/metrics.py, lossless_columns: within TIE_ULPS of the target's top-1)."""
    checked = [r for r in ok if r["lossless"] is not None]
    if not checked:
        return "not checked (check_lossless=true compares each output with autoregressive greedy's)"
    columns = metrics.lossless_columns(checked)
    n = len(checked)
    identical = round(columns["lossless"] * n)
    real = columns["real_divergences"]
    line = f"{identical}/{n} identical to autoregressive greedy"
    if identical == n:
        return line
    ties = n - identical - real
    line += (f"; {identical + ties}/{n} up to ties ({ties} depart{'s' if ties == 1 else ''} only at ties, within "
             f"{metrics.TIE_ULPS} ulps)")
    if real:
        first = next(r for r in checked if not r["lossless"] and not r["divergence_tie"])
        where = first["first_real_divergence"]
        line += f"; {real} real divergence{'s' if real > 1 else ''} (first: {first['key']} at token {where})"
    return line
