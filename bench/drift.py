"""Did the machine's speed drift during a run? A speedup divides times taken minutes apart (the
method's and autoregressive's), which a machine that slowed down or sped up between them (another
job on the cores, a throttled clock) distorts. So a run times the target's one-token step before
its first timed prompt and after its last, keeps both (provenance.json, `reference_step`), and
warns when they differ by more than DRIFT_BOUND.

Two probes can both land in fast stretches of a machine whose speed moves prompt by prompt (a host
whose memory bandwidth other tenants share: the one-token step is memory-bound, a wide verification
compute-bound, so every speedup rises while the bandwidth is low; results/reference/forecast/
cpu_cross_dtype/, eager_zen4). So the check also keeps, as `during`, the autoregressive reference's
own decoding step on each timed prompt (`prompt_step_ms`) and warns when the slowest is more than
DRIFT_BOUND above the fastest."""
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


def prompt_step_ms(run: dict) -> float | None:
    """An autoregressive run's mean decoding step on its prompt in ms (a record, or a record's
    `reference`: latency_s, ttft_s, steps): its time after the prefill over the steps after it; None
    for a run of one step. (metrics.decode_step_ms pools steps over records' traces; check_lossless's
    reference keeps no trace, so this reads the run's own totals.)"""
    if run.get("steps", 0) < 2 or run.get("latency_s") is None or run.get("ttft_s") is None:
        return None
    return 1e3 * (run["latency_s"] - run["ttft_s"]) / (run["steps"] - 1)


def spread(step_ms: list[float | None], bound: float = DRIFT_BOUND) -> dict | None:
    """What provenance keeps of the reference's steps prompt by prompt (`during`): each prompt's, the
    fastest and slowest, how much slower the slowest is and whether that passes the bound; None for
    fewer than two prompts."""
    steps = [s for s in step_ms if s is not None]
    if len(steps) < 2:
        return None
    fastest, slowest = min(steps), max(steps)
    change = slowest / fastest - 1.0
    return {"prompt_step_ms": steps, "fastest_ms": fastest, "slowest_ms": slowest, "change": change, "bound": bound,
            "drifted": change > bound}


def warn(result: dict, what: str) -> None:
    """Say on stderr when `what` (a run, a dataset's entries) drifted, between the probes or between prompts."""
    for line in (warning(result, what), warning_during(result.get("during"), what)):
        if line:
            print(line, file=sys.stderr, flush=True)


CONSEQUENCE = "so its speedups are less certain than their intervals say"


def warning(result: dict, what: str) -> str | None:
    """The line warn() prints when `what` drifted between the probes, else None."""
    if not result["drifted"]:
        return None
    return (f"[bench] warning: the target's one-token step took {result['start_ms']:.1f} ms before {what} and "
            f"{result['end_ms']:.1f} ms after ({100 * result['change']:+.0f}%, beyond +-{100 * result['bound']:.0f}%): "
            f"the machine's speed changed during the run, {CONSEQUENCE}")


def warning_during(during: dict | None, what: str) -> str | None:
    """The line warn() prints when the reference's step moved between `what`'s prompts, else None."""
    if not during or not during["drifted"]:
        return None
    return (f"[bench] warning: the autoregressive reference's decoding step ranged from {during['fastest_ms']:.1f} to "
            f"{during['slowest_ms']:.1f} ms over {what} (+{100 * during['change']:.0f}%, beyond "
            f"{100 * during['bound']:.0f}%): the machine's speed changed between prompts, {CONSEQUENCE}")
