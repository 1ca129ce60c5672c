"""The loss-curve PNG every training script writes next to the file it trained."""
from __future__ import annotations

from pathlib import Path

from ..plotting import entry_styles, legend_beside, pyplot, save, title


def save_loss_curve(weights: Path, curves: dict[str, list[float]], ylabel: str, what: str, where: str) -> Path:
    """One line per curve (label -> loss per step; NaN where a curve has no value), saved as `weights` (a file,
    or a checkpoint directory) with a .png suffix; `what` was trained, `where` (plotting.setup_of the target);
    prints what was written."""
    fig, ax = pyplot().subplots(figsize=(5.5, 3.2), layout="constrained")
    styles = entry_styles(curves)
    for label, values in curves.items():
        ax.plot(values, label=label, lw=0.8, color=styles[label]["color"])
    ax.set_xlabel("optimizer step (steps)")
    ax.set_ylabel(f"{ylabel} (nats)")
    title(ax, what, where)
    if len(curves) > 1:
        legend_beside(ax)
    png = save(fig, weights.with_suffix(".png"), dpi=100)
    size = sum(f.stat().st_size for f in weights.iterdir()) if weights.is_dir() else weights.stat().st_size
    print(f"wrote {weights} ({size / 1e6:.1f} MB) and {png.name}")
    return png
