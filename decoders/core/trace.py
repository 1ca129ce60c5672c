"""What a decoder returns: the new tokens plus one `Step` per target forward pass.

Metrics (bench/metrics.py) are computed from these fields only, so every decoder is
measured the same way.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple, Protocol


@dataclass
class Step:
    """One target forward pass and what it committed."""

    # tokens committed by this pass, the bonus included (>= 1, except a final pass cut by max_new_tokens/EOS)
    committed: int
    forward_tokens: int  # tokens fed to the target in this pass
    context_tokens: int  # KV-cache length before the pass (for attention FLOPs)
    draft_tokens: int = 0  # tokens proposed for verification in this pass
    accepted_draft_tokens: int = 0  # of those, how many were committed
    draft_forward_tokens: int = 0  # tokens fed to a draft model or heads for this pass
    draft_flops: float = 0.0  # FLOPs spent drafting for this pass (decoders with a draft fill it)
    draft_prefill_flops: float = 0.0  # of draft_flops, the draft's pass over the prompt (its own prefill)
    target_time: float = 0.0  # seconds in the target forward
    draft_time: float = 0.0  # seconds drafting
    overhead_time: float = 0.0  # the rest of the step: sampling, verification, bookkeeping
    info: dict = field(default_factory=dict)  # method-specific extras (pool size, hit, ...)


@dataclass
class Generation:
    tokens: list[int]  # new token ids, EOS included if produced, nothing after it
    steps: list[Step]
    ttft: float  # seconds from the call until the first new token was known
    stop_reason: str  # "eos" or "length"

    def trace_columns(self) -> dict[str, list]:
        """The per-step trace as columns (compact in JSON records), with each step's `position`."""
        cols: dict[str, list] = {}
        for step in self.steps:
            for key, value in asdict(step).items():
                cols.setdefault(key, []).append(value)
        if self.steps:
            cols["position"] = output_positions(cols["committed"])
        return cols


def output_positions(committed: list[int]) -> list[int]:
    """Each step's position in the output: the new tokens committed before it (the prefill step is at 0).
    Records keep it so that acceptance can be read against how far into a long answer a step is."""
    positions, total = [], 0
    for n in committed:
        positions.append(total)
        total += n
    return positions


class Clock:
    """Seconds spent in timed regions, summed. `sync` is called before each reading of the clock
    (torch.cuda.synchronize on GPU) so that asynchronous kernels are charged to the region that
    launched them, and work launched before a region is not."""

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync or (lambda: None)
        self.seconds = 0.0

    @contextmanager
    def __call__(self):
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.seconds += time.perf_counter() - t0


class StepTime(NamedTuple):
    """One step's split of its time, in seconds, and when it ended (seconds from the decode's start)."""

    target: float
    draft: float
    overhead: float  # the rest of the step: sampling, verification, bookkeeping
    at: float


class Tracer:
    """Times steps and splits each into target / draft / overhead on the host's clock."""

    def __init__(self, sync: Callable[[], None] | None = None):
        self.start = time.perf_counter()
        self._step_start = self.start
        self._target, self._draft = Clock(sync), Clock(sync)
        self._steps: list[tuple[dict, StepTime]] = []

    def target(self):
        """Time spent in the target forward."""
        return self._target()

    def draft(self):
        """Time spent drafting (draft model, heads, n-gram lookups)."""
        return self._draft()

    def end_step(self, **fields) -> None:
        """Close the current step (`fields`: what the caller keeps with it); its overhead is whatever was
        not target or draft time."""
        now = time.perf_counter()
        target, draft = self._target.seconds, self._draft.seconds
        overhead = max(0.0, (now - self._step_start) - target - draft)
        self._steps.append((fields, StepTime(target, draft, overhead, now - self.start)))
        self._step_start = now
        self._target.seconds = self._draft.seconds = 0.0

    def timed(self) -> list[tuple[dict, StepTime]]:
        """Each step's fields and times, in order."""
        return self._steps

    def finish(self, tokens: list[int], stop_ids) -> Generation:
        return generation(self.timed(), tokens, stop_ids)


class DeviceTracer:
    """Tracer's split on a GPU's own timeline. Each region's ends and each step's end are timing events
    that the host records as it passes (`event()` makes and records one: that waits for nothing), read
    once, when the decode finishes. Tracer's clock made the host wait at each region's start and end,
    four times a step beside the one read a step needs (the accepted tokens), so the host could never
    run ahead of the device as the authors' loops do. A region is charged the device time between its
    events: the work it launched, or, where the device was idle waiting for the host, the host's time."""

    def __init__(self, event: Callable[[], "TimingEvent"]):
        self.event = event
        self._start = event()
        self._spans: dict[str, list] = {"target": [], "draft": []}  # this step's (start, end) events per region
        self._steps: list[tuple[dict, "TimingEvent", list, list]] = []  # fields, end, target spans, draft spans

    @contextmanager
    def _span(self, region: str):
        start = self.event()
        try:
            yield
        finally:
            self._spans[region].append((start, self.event()))

    def target(self):
        return self._span("target")

    def draft(self):
        return self._span("draft")

    def end_step(self, **fields) -> None:
        self._steps.append((fields, self.event(), self._spans["target"], self._spans["draft"]))
        self._spans = {"target": [], "draft": []}

    def timed(self) -> list[tuple[dict, StepTime]]:
        last = self._steps[-1][1] if self._steps else self._start
        last.synchronize()  # the decode's one wait for its timer: every event before it has run too
        timed, before = [], self._start
        for fields, end, target, draft in self._steps:
            t, d = (sum(a.elapsed_time(b) for a, b in spans) / 1e3 for spans in (target, draft))
            total = before.elapsed_time(end) / 1e3
            timed.append((fields, StepTime(t, d, max(0.0, total - t - d), self._start.elapsed_time(end) / 1e3)))
            before = end
        return timed

    def finish(self, tokens: list[int], stop_ids) -> Generation:
        return generation(self.timed(), tokens, stop_ids)


def generation(timed: list[tuple[dict, StepTime]], tokens: list[int], stop_ids) -> Generation:
    """A decode's Generation from its tracer's steps (their fields are Step's)."""
    steps = [Step(target_time=t.target, draft_time=t.draft, overhead_time=t.overhead, **fields) for fields, t in timed]
    return Generation(tokens=tokens, steps=steps, ttft=timed[0][1].at if timed else 0.0,
                      stop_reason=stop_reason(tokens, stop_ids))


class TimingEvent(Protocol):
    """What DeviceTracer reads of an event (torch.cuda.Event(enable_timing=True), recorded)."""

    def elapsed_time(self, end: "TimingEvent") -> float: ...  # milliseconds from this event to `end`

    def synchronize(self) -> None: ...


def new_tracer(sync: Callable[[], None] | None,
               event: Callable[[], TimingEvent] | None = None) -> Tracer | DeviceTracer:
    """The tracer of one decode: on the device's own timeline where `event` records timing events there
    (LM.timing_event, a single GPU), else the host's clock, `sync` before each reading."""
    return Tracer(sync) if event is None else DeviceTracer(event)


def stop_reason(tokens: list[int], stop_ids) -> str:
    return "eos" if tokens and tokens[-1] in stop_ids else "length"


def check_generation(gen: Generation, max_new_tokens: int, stop_ids) -> None:
    """The DESIGN.md decoder contract; the runner checks it on every generation of every run."""
    tokens = gen.tokens
    committed = sum(s.committed for s in gen.steps)
    problems = []
    if not 1 <= len(tokens) <= max_new_tokens:
        problems.append(f"{len(tokens)} tokens for max_new_tokens={max_new_tokens}")
    if any(t in stop_ids for t in tokens[:-1]):
        problems.append("tokens after a stop token")
    if committed != len(tokens):
        problems.append(f"steps commit {committed} tokens, output has {len(tokens)}")
    if problems:
        raise RuntimeError("decoder broke the Generation contract: " + "; ".join(problems))


def truncate_at_stop(tokens: list[int], stop_ids, max_new_tokens: int) -> list[int]:
    """Cut a committed token list after the first stop token and at max_new_tokens."""
    tokens = tokens[:max_new_tokens]
    for i, tok in enumerate(tokens):
        if tok in stop_ids:
            return tokens[: i + 1]
    return tokens
