"""The host's allocator told to keep freed blocks for reuse.

Every step allocates and frees the same big tensors: a tree's logits rows are a megabyte each at a
262k-token vocabulary (17 rows: 17 MB). glibc's malloc hands blocks that big to the OS on free (munmap,
or trimming the heap's top) and takes them back on the next allocation (a page fault per 4 KiB touched):
on a CPU at 262k that was 0.3-1.3 ms a step, charged to whichever line freed the previous step's scores.
Raising its mmap threshold to the most glibc allows and its trim threshold above any step's working set
keeps those blocks in the heap; the process holds on to memory it freed, up to its peak, which the
memory estimate already counts. Process-wide and idempotent; a C library without mallopt is left as is.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit: half its heap's maximum size
TRIM_THRESHOLD = 1 << 30

_set: str | None = None


def keep_freed_blocks() -> str:
    """Set once per process; returns what the host allocator does, for provenance."""
    global _set
    if _set is None:
        _set = _mallopt()
    return _set


def _mallopt() -> str:
    if not sys.platform.startswith("linux"):
        return "default"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "default"
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "default"
    return f"malloc keeps freed blocks up to {MMAP_THRESHOLD_MAX >> 20} MiB (mmap threshold), trims above " \
           f"{TRIM_THRESHOLD >> 20} MiB"
