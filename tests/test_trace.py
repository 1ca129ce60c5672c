"""The per-step split of a decode's time: on the host's clock (Tracer), or on a GPU's own timeline
from events read once at the end (DeviceTracer), which makes the host wait for nothing while it
decodes. Here the events are stood for by a fake whose clock the test moves.
"""
from __future__ import annotations

import time

import pytest

from decoders.core import trace
from decoders.core.batch import decode_batch
from decoders.core.sampling import Sampling
from decoders.core.trace import DeviceTracer, Tracer
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.prompt_lookup import PromptLookupDecoding
from helpers import tiny_lm


class FakeEvents:
    """A factory of recorded timing events on a clock (`now`, seconds): time.perf_counter's, or the test's."""

    def __init__(self, clock=None):
        self.clock, self.synchronized = clock or time.perf_counter, 0

    def __call__(self):
        return FakeEvent(self, self.clock())


class FakeEvent:
    def __init__(self, owner: FakeEvents, at: float):
        self.owner, self.at = owner, at

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event's

    def synchronize(self) -> None:
        self.owner.synchronized += 1


def scripted(tracer, clock: list[float]):
    """Two steps: draft 2 s, target 5 s, 1 s else; then target 3 s, draft twice 0.5 s, 0.25 s else."""
    def wait(seconds):
        clock[0] += seconds
    for regions, rest, fields in (([("draft", 2), ("target", 5)], 1, dict(committed=1)),
                                  ([("target", 3), ("draft", 0.5), ("draft", 0.5)], 0.25, dict(committed=3))):
        for region, seconds in regions:
            with getattr(tracer, region)():
                wait(seconds)
        wait(rest)
        tracer.end_step(forward_tokens=1, context_tokens=0, **fields)
    return tracer.finish([1, 2, 3, 4], set())


def test_the_device_timeline_splits_steps_as_the_host_clock_does(monkeypatch):
    """The same regions timed both ways give the same Steps and TTFT; the device tracer's events are
    waited for once, at the end, and its `sync` never."""
    clock = [100.0]
    monkeypatch.setattr(trace.time, "perf_counter", lambda: clock[0])
    syncs = []
    on_host = scripted(Tracer(lambda: syncs.append(1)), clock)
    assert len(syncs) == 10  # the control: each region's start and end
    events = FakeEvents(lambda: clock[0])
    on_device = scripted(DeviceTracer(events), clock)
    assert events.synchronized == 1
    assert on_device == on_host
    assert [(s.draft_time, s.target_time, s.overhead_time) for s in on_device.steps] == [(2, 5, 1), (1, 3, 0.25)]
    assert on_device.ttft == 8


@pytest.mark.parametrize("decode", ["autoregressive", "prompt_lookup", "batch"])
def test_a_decode_timed_on_the_device_timeline_never_waits(decode):
    """With LM.timing_event set (a GPU's), the loop, the batch loop and the autoregressive baseline time
    on events: the model's sync is never called, the events are waited for once, and each step's times
    add up to the span of its events; the tokens and step fields are the host-timed decode's."""
    lm = tiny_lm(seed=1)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]

    def run():
        if decode == "autoregressive":
            return autoregressive_decode(lm, prompt, 12, Sampling(), set())
        if decode == "batch":  # a second row, shorter, leaves the batch early: the first row's last steps are alone
            gens, _ = decode_batch(PromptLookupDecoding(), lm, [prompt, prompt[:5]], [12, 5], [Sampling()] * 2,
                                   set())
            assert gens[1].ttft == gens[0].ttft and len(gens[1].steps) < len(gens[0].steps)
            return gens[0]
        return PromptLookupDecoding().generate(lm, prompt, 12, Sampling(), set())

    syncs = []
    lm.sync = lambda: syncs.append(1)
    on_host = run()
    assert syncs, "the control: the host clock synchronises"
    syncs.clear()
    lm.timing_event = events = FakeEvents()
    start = time.perf_counter()
    on_device = run()
    assert not syncs and events.synchronized == 1
    assert on_device.tokens == on_host.tokens
    fields = lambda g: [(s.committed, s.forward_tokens, s.draft_tokens) for s in g.steps]  # noqa: E731
    assert fields(on_device) == fields(on_host)
    spent = sum(s.target_time + s.draft_time + s.overhead_time for s in on_device.steps)
    assert all(min(s.target_time, s.draft_time, s.overhead_time) >= 0 for s in on_device.steps)
    assert 0 < on_device.ttft <= spent <= time.perf_counter() - start


@pytest.mark.parametrize("peer", ["hf_generate", "hf_assisted"])
def test_transformers_loops_are_timed_as_ours(peer):
    """generate()'s forwards (and an assistant's) are timed on the events too where ours are: the model's
    sync is called only around the whole call (twice), where the host clock calls it at every forward's
    start and end (the control); the steps are the same, their times positive and within the call."""
    from decoders.methods.draft_model import SelfDraft
    from decoders.methods.hf_peers import HFAssisted, HFGenerate
    lm = tiny_lm(seed=2)
    decoder = HFGenerate() if peer == "hf_generate" else HFAssisted(draft=SelfDraft(layers=1))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    decoder.generate(lm, prompt, 4, Sampling(), set())  # the assistant built, generate() warmed up
    syncs = []
    lm.sync = lambda: syncs.append(1)
    on_host = decoder.generate(lm, prompt, 12, Sampling(), set())
    forwards = len(on_host.steps) + sum(s.draft_forward_tokens > 0 for s in on_host.steps)
    assert len(syncs) >= 2 + 2 * forwards, "the control: the host clock synchronises at every forward"
    syncs.clear()
    lm.timing_event = events = FakeEvents()
    start = time.perf_counter()
    on_device = decoder.generate(lm, prompt, 12, Sampling(), set())
    assert len(syncs) == 2 and on_device.tokens == on_host.tokens
    fields = lambda g: [(s.committed, s.forward_tokens, s.draft_forward_tokens) for s in g.steps]  # noqa: E731
    assert fields(on_device) == fields(on_host)
    assert all(s.target_time > 0 and s.draft_time >= 0 for s in on_device.steps)
    assert (peer == "hf_assisted") == any(s.draft_time > 0 for s in on_device.steps)
    assert sum(s.target_time + s.draft_time + s.overhead_time for s in on_device.steps) <= time.perf_counter() - start
    assert events.synchronized == 0  # read after the call's own final sync
