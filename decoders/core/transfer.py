"""Host-to-device copies that do not make the host wait.

A tensor made from a Python list lives in pageable host memory, and copying it to a GPU blocks the
host until the copy has run, behind every kernel already queued: each such copy stops the host from
running ahead of the device (on an H200, three of the five waits a step of recycling made:
results/reference/gpu/2026-11-27-h200/). From pinned memory the copy is queued like a kernel;
torch's pinned allocator keeps the block until the copy has run, so the source may be dropped at once.
"""
from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list, a number or a tensor) as a tensor on `device`; from the host to a GPU without
    blocking the host. Elsewhere as torch.as_tensor(values, dtype=dtype, device=device)."""
    device = torch.device(device)
    if device.type != "cuda" or (isinstance(values, torch.Tensor) and values.device.type != "cpu"):
        return torch.as_tensor(values, dtype=dtype, device=device)
    # contiguous: an expanded view (BPD's candidates per beam) cannot be pinned in place
    return torch.as_tensor(values, dtype=dtype).contiguous().pin_memory().to(device, non_blocking=True)


def reads_wait(device: torch.device | str) -> bool:
    """Whether the host reading a tensor on `device` waits for everything queued there (a GPU's). Where it
    does, a drafted tree stays on the device until verification reads it (tree.DeviceTree): a step then
    makes the host wait once. The exactness tests turn it on to run that path on a CPU."""
    return torch.device(device).type != "cpu"


@contextmanager
def sync_counter(root: Path | None = None):
    """Counter of the code lines that made the host wait for a CUDA device, by "path:line" (paths under
    `root` relative to it), while the block runs. Each synchronising operation warns under
    torch.cuda.set_sync_debug_mode("warn"); the warning is attributed to the Python line that called it."""
    sites = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for w in caught:
                if "synchroniz" in str(w.message):
                    path = Path(w.filename)
                    sites[f"{path.relative_to(root) if root and path.is_relative_to(root) else path}:{w.lineno}"] += 1
