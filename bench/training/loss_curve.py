"""The loss-curve PNG every training script writes next to the file it trained."""
from __future__ import annotations

from pathlib import Path


def save_loss_curve(weights: Path, curves: dict[str, list[float]], ylabel: str, title: str) -> Path:
    """One line per curve (label -> loss per step; NaN where a curve has no value), saved as
    `weights` (a file, or a checkpoint directory) with a .png suffix; prints what was written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    for label, values in curves.items():
        ax.plot(values, label=label, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(curves) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = weights.with_suffix(".png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    size = sum(f.stat().st_size for f in weights.iterdir()) if weights.is_dir() else weights.stat().st_size
    print(f"wrote {weights} ({size / 1e6:.1f} MB) and {png.name}")
    return png
