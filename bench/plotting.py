"""What every figure of the harness shares: matplotlib without a display, a colour and a marker per entry
(no two entries of a figure alike), the setup (model, device, dtype) in the title, legends beside the axes
(never over the data), point labels that never overlap, and the file written whole."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# Filled markers that stay distinct in print; with the ten colours below every pair differs for up to 60 entries.
MARKERS = "osD^vP*X<>hd"
COLOURS = "tab10"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def entry_styles(labels) -> dict[str, dict]:
    """label -> {"color", "marker"}: neighbours differ in both, and no two labels share the pair."""
    cmap = pyplot().get_cmap(COLOURS)
    return {label: {"color": cmap(i % 10), "marker": MARKERS[i % len(MARKERS)]} for i, label in enumerate(labels)}


def setup(provenance: dict | None, model: str | None = None) -> str:
    """The model, device and dtype a figure's numbers were measured on, from a provenance.json's fields
    (bench/provenance.py): "smollm2-135m, Intel Xeon (2 threads), float32"; a GPU by its name."""
    info = provenance or {}
    device = info.get("device_name") or info.get("device") or "unknown device"
    if str(info.get("device", "cpu")).startswith("cpu") and info.get("torch_threads"):
        threads = info["torch_threads"]
        device += f" ({threads} thread{'s' if threads != 1 else ''})"
    parts = [model or info.get("model"), device, info.get("dtype") or "unknown dtype"]
    return ", ".join(str(p) for p in parts if p)


def setup_of(lm) -> str:
    """setup() of a loaded model: its name, device (threads on a CPU) and dtype."""
    import torch

    from decoders.tuning.profile import device_name

    return setup({"device": lm.device.type, "device_name": device_name(lm.device),
                  "torch_threads": torch.get_num_threads(), "dtype": str(lm.dtype).replace("torch.", "")}, lm.name)


def title(ax, what: str, where: str) -> None:
    """`what` the figure shows, then on a second line where it was measured."""
    ax.set_title(f"{what}\n{where}", fontsize=8)


def legend_beside(ax, **kwargs) -> None:
    """The legend right of the axes, outside them (save() makes room for it)."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False,
                  fontsize=kwargs.pop("fontsize", 7), **kwargs)


def label_points(ax, xs, ys, texts, fontsize: float = 7) -> list:
    """Each point's text placed at the first of a few offsets where it overlaps no label placed before (nor
    leaves the axes); a label with no free place is left out (the figure's CSV holds every value)."""
    fig = ax.figure
    if not hasattr(fig.canvas, "get_renderer"):  # a Figure made without pyplot (bench/scaling.py)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    fig.canvas.draw()  # the layout settled, so that the boxes measured are where the labels end up
    renderer = fig.canvas.get_renderer()
    placed, boxes = [], []
    inside = ax.get_window_extent(renderer)
    for x, y, text in zip(xs, ys, texts):
        for dx, dy in ((4, 4), (4, -10), (-4, 4), (-4, -10), (0, 8), (0, -14)):
            label = ax.annotate(str(text), (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                                ha="left" if dx >= 0 else "right", alpha=0.8)
            box = label.get_window_extent(renderer)
            if (not any(box.overlaps(b) for b in boxes) and inside.contains(box.x0, box.y0)
                    and inside.contains(box.x1, box.y1)):
                placed.append(label)
                boxes.append(box)
                break
            label.remove()
    return placed


def interval(values, low, high) -> np.ndarray:
    """(2, n) distances below and above each value for errorbar(); 0 where an end is missing."""
    values, low, high = (np.asarray(a, dtype=float) for a in (values, low, high))
    return np.nan_to_num(np.vstack([values - low, high - values]), nan=0.0).clip(min=0.0)


def save(fig, path: Path, dpi: int = 110) -> Path:
    """The figure as PNG at `path`, its legends and labels inside the image, in 256 colours (a quarter of
    the bytes; a plot holds a few dozen), written whole (a temporary file renamed over it), then closed."""
    from PIL import Image

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
    with Image.open(tmp) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    small.save(tmp, format="PNG", optimize=True)
    tmp.replace(path)
    pyplot().close(fig)
    return path
