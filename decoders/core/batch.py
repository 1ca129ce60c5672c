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

import time
from dataclasses import dataclass, field
from typing import Sequence

from .contract import Batches
from .lm import LM
from .loop import Accept, Proposal, Proposer, Scores, layout, verify
from .sampling import Sampler, Sampling
from .trace import Generation, Step, stop_reason, truncate_at_stop


@dataclass
class BatchStats:
    rows: int  # prompts decoded together
    steps: int = 0  # batched target forwards
    wall_s: float = 0.0  # from the first proposal to the last row's last token
    draft_s: float = 0.0  # every row's proposing and committing, summed over steps
    fed_tokens: int = 0  # tokens the rows fed, summed over forwards
    padded_tokens: int = 0  # (active rows x widest feed), summed over forwards: what was computed
    rows_per_step: list[int] = field(default_factory=list)

    @property
    def padding_waste(self) -> float:
        """Share of the computed token slots that were padding."""
        return 1 - self.fed_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def as_dict(self) -> dict:
        return {"rows": self.rows, "steps": self.steps, "wall_s": self.wall_s, "draft_s": self.draft_s, "fed_tokens": self.fed_tokens,
                "padded_tokens": self.padded_tokens, "padding_waste": self.padding_waste}


@dataclass
class _Row:
    proposer: Proposer
    sampler: Sampler
    sequence: list[int]
    tokens: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    cached: int = 0  # committed tokens in this row's cache
    done: bool = False


def _feed(row: _Row, proposal: Proposal) -> tuple[list[int], object, object, list[int]]:
    """Row's tokens, positions, mask among them and logits rows, laid out as loop.score lays them out."""
    tree, side = proposal.tree, proposal.side
    uncached = row.sequence[row.cached:]
    if uncached[-1] != tree.tokens[0]:
        raise ValueError("the proposal's root must be the last committed token")
    u, n = len(uncached), len(tree)
    s = len(side.tokens) if side is not None else 0
    if side is None and tree.is_chain():  # fed causally, as loop.score feeds a chain
        mask, positions = None, range(row.cached, row.cached + u + n - 1)
    else:
        mask, positions = layout(row.cached, u, tree, side)
        mask = mask[:, row.cached:]
    wanted = [u - 1, *(u + r for r in side.rows)] if side is not None else [u - 1]
    wanted += list(range(u + s, u + s + n - 1))
    tokens = uncached + (side.tokens if side is not None else []) + tree.tokens[1:]
    return tokens, positions, mask, wanted


def _scores(proposal: Proposal, logits, extra, u: int) -> Scores:
    """Split one row's forward output as loop.score does."""
    side = proposal.side
    hidden = extra if proposal.hidden else None
    features = extra if proposal.features else None
    if side is None:
        return Scores(logits, None, hidden, features)
    k, s = len(side.rows), len(side.tokens)
    tree_rows = lambda x: x[[0, *range(1 + k, len(x))]]  # noqa: E731
    return Scores(tree_rows(logits), logits[1:1 + k], tree_rows(hidden) if hidden is not None else None,
                  features[[*range(u), *range(u + s, len(features))]] if features is not None else None)


def speculative_decode_batch(lm: LM, proposers: Sequence[Proposer], prompts: Sequence[Sequence[int]],
                             max_new_tokens: int, samplers: Sequence[Sampler], stop_ids,
                             accept: Accept | None = None) -> tuple[list[Generation], BatchStats]:
    """Decode prompts[r] with proposers[r] and samplers[r], all rows in one target forward per step.
    Under greedy each row's tokens are what speculative_decode gives for its prompt alone (up to
    float ties: a batched GEMM may sum in another order)."""
    rows = [_Row(p, s, list(ids)) for p, s, ids in zip(proposers, samplers, prompts)]
    stats = BatchStats(rows=len(rows))
    cache = lm.new_batch_cache(len(rows))
    active = list(range(len(rows)))  # rows still decoding, in cache order
    start = step_start = time.perf_counter()
    first_token: dict[int, float] = {}
    while active:
        draft_time = 0.0
        proposals, feeds = [], []
        for r in active:
            row = rows[r]
            lm.sync()  # a draft timer starts and stops with the device idle, like the target's
            t0 = time.perf_counter()
            proposals.append(row.proposer.propose(row.sequence, max_new_tokens - len(row.tokens) - 1))
            lm.sync()
            draft_time += time.perf_counter() - t0
            feeds.append(_feed(row, proposals[-1]))
        lm.sync()
        t0 = time.perf_counter()
        outputs = lm.forward_batch([f[0] for f in feeds], cache, [f[1] for f in feeds], [f[2] for f in feeds],
                                   [f[3] for f in feeds], hidden=any(p.hidden for p in proposals),
                                   features=next((p.features for p in proposals if p.features), False))
        lm.sync()
        target_time = time.perf_counter() - t0
        width = max(len(f[0]) for f in feeds)
        slot0 = len(cache) - width  # where this forward's slots begin; row r's tokens are right-aligned in them
        stats.steps += 1
        stats.fed_tokens += sum(len(f[0]) for f in feeds)
        stats.padded_tokens += len(feeds) * width
        stats.rows_per_step.append(len(active))
        kept, fields = [], []
        for r, proposal, (feed, _, _, _), (logits, extra) in zip(active, proposals, feeds, outputs):
            row = rows[r]
            u = len(row.sequence) - row.cached
            scores = _scores(proposal, logits, extra, u)
            tree, side = proposal.tree, proposal.side
            path, bonus = accept(tree, scores.logits, row.sampler) if accept is not None else verify(proposal, scores.logits, row.sampler)
            new = truncate_at_stop([tree.tokens[i] for i in path[1:]] + [bonus], stop_ids, max_new_tokens - len(row.tokens))
            row.tokens += new
            row.sequence += new
            lm.sync()
            t1 = time.perf_counter()
            info = row.proposer.commit(proposal, scores, path, row.sequence)
            lm.sync()
            draft_time += time.perf_counter() - t1
            s = len(side.tokens) if side is not None else 0
            fields.append(dict(accepted=len(new), forward_tokens=len(feed), context_tokens=row.cached,
                               draft_tokens=len(tree) - 1, accepted_draft_tokens=min(len(path) - 1, len(new)),
                               draft_forward_tokens=proposal.draft_forward_tokens, draft_flops=proposal.draft_flops,
                               draft_prefill_flops=proposal.draft_prefill_flops, info=info))
            row.done = row.tokens[-1] in stop_ids or len(row.tokens) >= max_new_tokens
            # The committed tokens through the root, then the accepted nodes (after the side branch).
            pad = width - len(feed)
            kept.append([pad + i for i in [*range(u), *(u - 1 + s + i for i in path[1:])]])
            row.cached += len(kept[-1])
        going = [i for i, r in enumerate(active) if not rows[r].done]
        if len(going) < len(active) and going:
            cache.select_rows(going)
        if going:
            cache.keep_tail(slot0, [kept[i] for i in going])
        now = time.perf_counter()
        stats.draft_s += draft_time
        for r, f in zip(active, fields):  # every row took part in the whole step
            rows[r].steps.append(Step(target_time=target_time, draft_time=draft_time,
                                      overhead_time=max(0.0, now - step_start - target_time - draft_time), **f))
            first_token.setdefault(r, now - start)
        active = [active[i] for i in going]
        step_start = now
    stats.wall_s = time.perf_counter() - start
    gens = [Generation(tokens=row.tokens, steps=row.steps, ttft=first_token[r], stop_reason=stop_reason(row.tokens, stop_ids))
            for r, row in enumerate(rows)]
    return gens, stats


def decode_batch(decoder: "Batches", lm: LM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 samplings: Sequence[Sampling], stop_ids) -> tuple[list[Generation], BatchStats]:
    """Run a decoder that batches on these prompts together; samplings[r] is row r's (its own seed)."""
    samplers = [Sampler(s, lm.output_device) for s in samplings]
    built = [decoder.proposer(lm, ids, sampler, stop_ids) for ids, sampler in zip(prompts, samplers)]
    return speculative_decode_batch(lm, [p for p, _ in built], prompts, max_new_tokens, samplers, stop_ids, built[0][1])


def latencies(gens: Sequence[Generation]) -> list[float]:
    """Each row's latency: the wall time from the batch's start to its last step's end."""
    return [sum(s.target_time + s.draft_time + s.overhead_time for s in g.steps) for g in gens]
