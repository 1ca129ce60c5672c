"""The host allocator keeps a step's big blocks for the next (decoders/core/host_memory.py): logits rows
are a megabyte each at a 262k vocabulary, and a block given back to the OS is faulted in again."""
import subprocess
import sys

import pytest

from decoders.core import host_memory

from helpers import REPO

# A step's logits and what it frees with them (three blocks of 8 MiB, as 262k-token rows are), read and
# freed. Prints, from glibc's mallinfo2, the bytes the step took as mmapped blocks (given back to the OS
# on free: faulted in again at the next step) and the bytes free in the heap after it (kept for reuse).
STEPS = """
import ctypes, sys, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
info = ctypes.CDLL(None).mallinfo2
info.restype = MallInfo2
if sys.argv[1] == "keep":
    from decoders.core.host_memory import keep_freed_blocks
    assert keep_freed_blocks() != "default"
before = info()
blocks = [torch.ones(8, 262_144) for _ in range(3)]
during = info()
assert sum(float(b.max()) for b in blocks) == 3
del blocks
print(during.hblkhd - before.hblkhd, info().fordblks)
"""


def allocation(mode: str) -> tuple[int, int]:
    # a fresh interpreter each: the setting is process-wide, and the fork server's may hold it
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    mapped, free = map(int, out.stdout.split())
    return mapped, free


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and mallinfo2 are glibc's")
def test_a_steps_big_blocks_stay_in_the_heap_for_the_next_step():
    mib = 1 << 20
    mapped, free = allocation("keep")
    assert mapped == 0 and free >= 24 * mib, f"{mapped / mib:.0f} MiB mmapped, {free / mib:.0f} MiB kept free"
    # negative control: a fresh process's own thresholds map each 8 MiB block and unmap it on free
    mapped, free = allocation("default")
    assert mapped >= 24 * mib and free < 8 * mib, \
        f"without the setting {mapped / mib:.0f} MiB mmapped, {free / mib:.0f} MiB kept: the test shows nothing"


def test_the_setting_is_recorded_and_set_once():
    first = host_memory.keep_freed_blocks()
    assert first == host_memory.keep_freed_blocks()
    if sys.platform.startswith("linux"):
        assert "32 MiB" in first
