"""Did the machine's speed drift during a run? A speedup divides times taken minutes apart (the
method's and autoregressive's), which a machine that slowed down or sped up between them (another
job on the cores, a throttled clock) distorts. So a run times the target's one-token step before
its first timed prompt and after its last, keeps both (provenance.json, `reference_step`), and
warns when they differ by more than DRIFT_BOUND."""
from __future__ import annotations

import statistics
import sys
import time

DRIFT_BOUND = 0.10  # of the step's time; the same CPU has run the step 35 ms one day and 44-51 ms the next
CONTEXT = 32  # cached tokens before the timed step
REPEATS = 7  # timed steps; the median is kept


def step_ms(lm) -> float:
    """The median over REPEATS of the target's one-token step after CONTEXT cached tokens, in ms
    (one untimed step first). The cache is cut back after each step, so every step is the same."""
    context = max(1, min(CONTEXT, lm.max_context - 1))
    ids = [i % lm.vocab_size for i in range(context)]
    cache = lm.new_cache()
    lm.forward(ids, cache, last_only=True)
    times = []
    for _ in range(REPEATS + 1):
        lm.sync()
        t0 = time.perf_counter()
        lm.forward([ids[-1]], cache, last_only=True)
        lm.sync()
        times.append(time.perf_counter() - t0)
        cache.crop(context)
    return 1e3 * statistics.median(times[1:])


def compare(start_ms: float, end_ms: float, bound: float = DRIFT_BOUND) -> dict:
    """What provenance keeps: both times, the relative change and whether it passes the bound."""
    change = end_ms / start_ms - 1.0
    return {"start_ms": start_ms, "end_ms": end_ms, "change": change, "bound": bound, "drifted": abs(change) > bound}


def warn(result: dict, what: str) -> None:
    """Say on stderr when `what` (a run, a dataset's entries) drifted."""
    if result["drifted"]:
        print(warning(result, what), file=sys.stderr, flush=True)


def warning(result: dict, what: str) -> str | None:
    """The line warn() prints when `what` drifted, else None."""
    if not result["drifted"]:
        return None
    return (f"[bench] warning: the target's one-token step took {result['start_ms']:.1f} ms before {what} and "
            f"{result['end_ms']:.1f} ms after ({100 * result['change']:+.0f}%, beyond +-{100 * result['bound']:.0f}%): "
            "the machine's speed changed during the run, so its speedups are less certain than their intervals say")
