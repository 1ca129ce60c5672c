"""The propose -> verify -> commit loop over a batch of prompts: one target forward per step for all rows.

Each row is what speculative_decode (loop.py) runs for one prompt: its own proposer, sampler and
committed tokens. A step asks every unfinished row for its proposal, feeds all of them in one
padded forward (LM.forward_batch: per-row positions and masks), verifies each row on its own
logits, and keeps in each row's cache only what that row committed (ragged acceptance). A row
that stops (stop token, max_new_tokens) leaves the batch and the rest go on: the batch shrinks.
It is not refilled with the next prompt because a prefill joining a decode step would pad every
row to the prompt's length in a rectangular (B, q) forward.

Time is attributed to rows as they experience it: a row's step lasts the whole batch step (the
forward and every row's drafting and verification), so its latency is the wall time from the
batch's start to its last token and its TTFT the time to its first. BatchStats keeps the batch's
own totals: forwards, wall time, and the padding its forwards computed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .contract import Batches, check_proposer
from .lm import LM
from .loop import Accept, Decoding, Feed, Proposal, Proposer, feed, propose, settled, split, verify_and_commit
from .sampling import Sampler, Sampling
from .trace import Generation, Step, new_tracer, stop_reason


@dataclass
class BatchStats:
    rows: int  # prompts decoded together
    steps: int = 0  # batched target forwards
    wall_s: float = 0.0  # from the first proposal to the last row's last token
    draft_s: float = 0.0  # every row's proposing and committing, summed over steps
    fed_tokens: int = 0  # tokens the rows fed, summed over forwards
    padded_tokens: int = 0  # (active rows x widest feed), summed over forwards: what was computed
    rows_per_step: list[int] = field(default_factory=list)

    def count_forward(self, feeds: list, width: int) -> None:
        """One batched forward: the rows' feeds, each padded to `width` tokens."""
        self.steps += 1
        self.fed_tokens += sum(len(f.tokens) for f in feeds)
        self.padded_tokens += len(feeds) * width
        self.rows_per_step.append(len(feeds))

    @property
    def padding_waste(self) -> float:
        """Share of the computed token slots that were padding."""
        return 1 - self.fed_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def as_dict(self) -> dict:
        return {"rows": self.rows, "steps": self.steps, "wall_s": self.wall_s, "draft_s": self.draft_s,
                "fed_tokens": self.fed_tokens, "padded_tokens": self.padded_tokens, "padding_waste": self.padding_waste}


@dataclass
class _Row(Decoding):
    steps: list[Step] = field(default_factory=list)
    cached: int = 0  # committed tokens in this row's cache


def speculative_decode_batch(lm: LM, proposers: Sequence[Proposer], prompts: Sequence[Sequence[int]],
                             max_new_tokens: int | Sequence[int], samplers: Sequence[Sampler], stop_ids, *,
                             accept: Accept | None = None) -> tuple[list[Generation], BatchStats]:
    """Decode prompts[r] with proposers[r] and samplers[r], all rows in one target forward per step.
    Under greedy each row's tokens are what speculative_decode gives for its prompt alone (up to
    float ties: a batched GEMM may sum in another order). max_new_tokens: one for every row, or
    row r's own (a long prompt's is cut by the context)."""
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    rows = [_Row(p, s, accept, list(ids), limit, stop_ids)
            for p, s, ids, limit in zip(proposers, samplers, prompts, limits)]
    stats = BatchStats(rows=len(rows))
    cache = lm.new_batch_cache(len(rows))
    active = rows  # rows still decoding, in cache order
    tracer = new_tracer(lm.sync, lm.timing_event)  # each step's times, shared by the rows in it
    while active:
        proposals, feeds = [], []
        for row in active:
            with tracer.draft():
                proposals.append(propose(row.proposer, row.sequence, row.room, prefill=not row.tokens))
                settled(proposals[-1])  # a tree still on the device is read now: the batched feed is built on the host
            feeds.append(feed(row.cached, row.sequence, proposals[-1]))
        with tracer.target():
            outputs = _forward(lm, cache, proposals, feeds)
        width = max(len(f.tokens) for f in feeds)
        slot0 = len(cache) - width  # where this forward's slots begin; row r's tokens are right-aligned in them
        stats.count_forward(feeds, width)
        kept, fields = [], []
        for row, proposal, fed, (logits, extra) in zip(active, proposals, feeds, outputs):
            step, path = verify_and_commit(row, proposal, fed, split(proposal, logits, extra, fed.uncached),
                                           tracer.draft)
            fields.append(step)
            kept.append([width - len(fed.tokens) + i for i in fed.kept(path)])  # after the row's left padding
            row.cached += len(kept[-1])
        going = [i for i, row in enumerate(active) if not row.done]
        if len(going) < len(active) and going:
            cache.select_rows(going)
        if going:
            cache.keep_tail(slot0, [kept[i] for i in going])
        tracer.end_step(rows=list(zip(active, fields)))  # every row took part in the whole step
        active = [active[i] for i in going]
    timed = tracer.timed()
    # The batch's wall time on the rows' own clock (the device's, on a GPU): a second clock read on
    # the host began later and, on a GPU, could end before the device did.
    stats.wall_s = timed[-1][1].at if timed else 0.0
    first_token: dict[int, float] = {}  # by id(row): when its first step ended
    for step, t in timed:
        stats.draft_s += t.draft
        for row, f in step["rows"]:
            row.steps.append(Step(target_time=t.target, draft_time=t.draft, overhead_time=t.overhead, **f))
            first_token.setdefault(id(row), t.at)
    gens = [Generation(tokens=row.tokens, steps=row.steps, ttft=first_token[id(row)],
                       stop_reason=stop_reason(row.tokens, stop_ids)) for row in rows]
    return gens, stats


def _forward(lm: LM, cache, proposals: list[Proposal], feeds: list[Feed]) -> list:
    """One padded target forward over every active row's feed: per row, (logits, extra)."""
    return lm.forward_batch(
        [f.tokens for f in feeds], cache,
        [f.positions if f.positions is not None else range(f.cached, f.cached + len(f.tokens)) for f in feeds],
        [f.mask[:, f.cached:] if f.mask is not None else None for f in feeds], [f.logits_rows for f in feeds],
        hidden=any(p.hidden for p in proposals),
        features=next((p.feature_layers for p in proposals if p.feature_layers), False))


def decode_batch(decoder: "Batches", lm: LM, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 samplings: Sequence[Sampling], stop_ids) -> tuple[list[Generation], BatchStats]:
    """Run a decoder that batches on these prompts together; samplings[r] is row r's (its own seed)."""
    samplers = [Sampler(s, lm.output_device) for s in samplings]
    built = [decoder.proposer(lm, ids, sampler, stop_ids) for ids, sampler in zip(prompts, samplers)]
    for proposer, _ in built:
        check_proposer(proposer)
    return speculative_decode_batch(lm, [p for p, _ in built], prompts, max_new_tokens, samplers, stop_ids,
                                    accept=built[0][1])


def latencies(gens: Sequence[Generation]) -> list[float]:
    """Each row's latency: the wall time from the batch's start to its last step's end."""
    return [sum(s.target_time + s.draft_time + s.overhead_time for s in g.steps) for g in gens]
