"""The one loop every draft-and-verify method runs: propose -> verify -> commit.

Each step, a proposer (decoders/methods/) builds a token tree after the last committed token,
its root. One target forward scores the committed tokens not yet cached, an optional side
branch and the tree; verification (verify.py) picks the accepted path and the target's own
next token after it (the bonus); the step commits them, the proposer updates its state, and
the target's cache keeps the committed tokens only. The split follows vLLM's proposer /
scorer / rejection sampler; the loop follows gpt-fast's speculative_decode.

The first step is the prefill: the prompt, with the proposer's tree if it drafts before the
target's first pass, else the root alone (an autoregressive step over the prompt).

batch.py runs the same step over B prompts: propose(), feed(), split() and verify_and_commit()
are shared; only the forward differs (LM.forward here, the fast path; LM.forward_batch there).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Collection, ContextManager, Protocol, Sequence

import numpy as np
import torch

from .kv_cache import KVCache
from .lm import LM
from .sampling import ArgmaxRows, PanelMaxima, Sampler
from .trace import Generation, new_tracer, truncate_at_stop
from .transfer import to_device
from .tree import DeviceTree, TokenTree, ancestor_rows
from .verify import verify_greedy, verify_sampling


@dataclass
class SideBranch:
    """Tokens the target scores beside the tree without verifying them (lookahead's Jacobi
    window). They see every committed token and each other as `mask` says, never the tree."""

    tokens: list[int]
    mask: torch.Tensor  # (s, s) bool: which side tokens each side token sees (itself included)
    offsets: torch.Tensor  # (s,) positions after the root
    rows: list[int]  # side tokens whose logits the proposer wants back, in this order


@dataclass
class Proposal:
    tree: TokenTree | DeviceTree  # node 0 is the root: the last committed token (DeviceTree: read with verification)
    # Sampling verification: row c is the distribution node c's token was drawn from (the root's row
    # is never read); None for deterministic candidates (n-gram guesses, heads' top-k).
    draft_probs: torch.Tensor | None = None
    draws: list[list[int]] | None = None  # per node, its children in draw order, duplicates kept (SpecInfer)
    without_replacement: bool = False  # siblings were drawn without replacement (Sequoia)
    side: SideBranch | None = None
    hidden: bool = False  # return the target's last hidden state for each tree node (heads read it)
    # Return the target's features (Scores.features) from these layers: LM.forward's `features`
    # (True: the last layer's output, pre-norm; a tuple: those layers' inputs, concatenated). EAGLE reads them.
    feature_layers: bool | tuple[int, ...] = False
    draft_forward_tokens: int = 0  # tokens fed to a draft model or heads for this proposal
    draft_flops: float = 0.0
    draft_prefill_flops: float = 0.0  # of draft_flops, the draft's own pass over the prompt
    top_k: int = 0  # the commit reads each row's top-k tokens (Scores.top): on a GPU, with verification's read


@dataclass
class Scores:
    """The target's forward over a proposal."""

    logits: torch.Tensor  # (len(tree), V): after each tree node
    side_logits: torch.Tensor | None = None  # (len(side.rows), V)
    hidden: torch.Tensor | None = None  # (len(tree), d) when the proposal asked for it
    # (uncached + len(tree) - 1, width) when the proposal asked for feature_layers: the uncached committed
    # tokens (the root last), then the tree after the root, so tree node i is row uncached - 1 + i
    features: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # (len(tree) + len(side.rows), V): both, as the forward returned them
    top_k: int = 0  # the proposal's top_k
    read: torch.Tensor | None = None  # the proposal's DeviceTree's `read`: read with the argmax
    maxima: PanelMaxima | None = None  # of `rows` (else `logits`), where the readout kept them (LM.maxima_of)
    _argmax: ArgmaxRows | None = field(default=None, init=False, repr=False)

    def argmax_rows(self) -> ArgmaxRows:
        """The argmax of every row, the tree's then the side branch's, read as asked (one reader a step:
        on a GPU verification and a proposer's commit share one read)."""
        if self._argmax is None:
            self._argmax = ArgmaxRows(self.rows if self.rows is not None else self.logits, self.top_k, self.read,
                                      self.maxima)
        return self._argmax

    def argmax(self, start: int = 0, stop: int | None = None) -> list[int]:
        """The argmax of rows start:stop, counting the tree's rows then the side branch's."""
        return self.argmax_rows().slice(start, stop)

    def top(self) -> list[list[int]]:
        """Each row's top_k tokens (the proposal's top_k), the tree's then the side branch's."""
        return self.argmax_rows().top()


class Proposer(Protocol):
    """One generation's drafting state, built per prompt by its method's proposer() and driven by
    the loop, one call of each per step:

        propose(sequence, room) -> Proposal     the tree after the last committed token
        (one target forward scores it; verification picks the path; the step's tokens are committed)
        commit(proposal, scores, path, sequence) -> the step's info, after updating the drafting state

    The first step is the prefill: the target reads the prompt and commits the first token. A
    proposer whose drafts come from the target's own pass (a draft model catching up on committed
    tokens, heads on the target's hidden state, EAGLE on its features) has nothing to draft before
    it and sets `waits_for_prefill`: the loop then does not call propose() at the prefill but
    scores the root alone, asking for what that proposer's proposals ask for (its `hidden` and
    `feature_layers`); commit() follows as at every step, and the prefill's info is {} (nothing
    was drafted). A proposer that does not say is asked at the prefill like at any step. State
    that propose() leaves for commit() is declared in __init__.
    """

    waits_for_prefill: bool  # optional: False when absent

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        """A tree rooted at sequence[-1] (the committed tokens so far). `room`: drafts beyond this
        many can never be committed (max_new_tokens)."""

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        """After verification: `path` is the accepted node indices from the root, `sequence` the
        committed tokens including this step's. Update drafting state; return the step's info."""


Accept = Callable[[TokenTree, torch.Tensor, Sampler], tuple[list[int], int]]  # (tree, logits, sampler) -> path, bonus


def verify(proposal: Proposal, scores: Scores, sampler: Sampler) -> tuple[list[int], int]:
    """Exact verification: greedy matching, or speculative sampling that keeps the target's distribution."""
    logits = scores.logits
    if sampler.greedy:
        return verify_greedy(proposal.tree, logits, scores.argmax_rows())
    return verify_sampling(proposal.tree, sampler.probs(logits), proposal.draft_probs, sampler.generator,
                           without_replacement=proposal.without_replacement, draws=proposal.draws)


def layout(cache_len: int, uncached: int, tree: TokenTree, side: SideBranch | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (q, cache_len + q) and positions for [the `uncached` committed tokens (the root last),
    side branch, tree nodes after the root]. Both branches see every committed token; a tree node
    sees its own ancestors, a side token what side.mask allows; neither branch sees the other.
    Built in numpy and made tensors once: each of its ten tensor operations cost more than all of it."""
    if side is None:  # the new tokens' block depends on the tree's shape alone, which static trees repeat
        block, offsets = tree_block(uncached, tuple(tree.parents), tuple(tree.depths))
    else:
        block, offsets = new_block(uncached, tuple(tree.parents), tree.depths, side)
    c, q = cache_len, len(offsets)
    mask = np.empty((q, c + q), dtype=np.bool_)
    mask[:, :c] = True
    mask[:, c:] = block
    return torch.from_numpy(mask), torch.from_numpy(offsets + c)


def new_block(u: int, parents: tuple[int, ...], depths: Sequence[int], side: SideBranch | None
              ) -> tuple[np.ndarray, np.ndarray]:
    """layout()'s mask over the new tokens only, (q, q), and their positions after the cache, (q,)."""
    s = len(side.tokens) if side is not None else 0
    q = u + s + len(parents) - 1
    block = np.zeros((q, q), dtype=np.bool_)
    block[:u, :u] = np.tri(u, dtype=np.bool_)
    block[u:, :u] = True
    block[u + s:, u + s:] = ancestor_rows(parents)[1:, 1:]
    offsets = [np.arange(u)]
    if side is not None:
        block[u:u + s, u:u + s] = side.mask.numpy()
        offsets.append(u - 1 + side.offsets.numpy())
    offsets.append(u - 1 + np.asarray(depths[1:], dtype=np.int64))
    return block, np.concatenate(offsets).astype(np.int64, copy=False)


@functools.lru_cache(maxsize=256)
def tree_block(u: int, parents: tuple[int, ...], depths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """new_block() without a side branch, cached by shape, read-only. After a forward the caches are
    cold, and building the block cost a static tree (Medusa's, Sequoia's, recycling's) 40-50 us of
    the 80-100 a layout took (scripts/step_overhead.py's `overhead: feed`)."""
    block, offsets = new_block(u, parents, depths, None)
    block.flags.writeable = offsets.flags.writeable = False  # shared by every caller of the cache
    return block, offsets


@dataclass
class Feed:
    """One prompt's part of a target forward: [the committed tokens not yet cached (the root last),
    the side branch, the tree's nodes after the root], laid out by layout()."""

    tokens: list[int] | torch.Tensor  # a tensor on the device where the tree is a DeviceTree
    cached: int  # committed tokens already in the target's cache
    uncached: int  # of `tokens`, the committed ones
    side: int  # of `tokens`, the side branch's
    mask: torch.Tensor | None  # (len(tokens), cached + len(tokens)); None: a chain without side branch, fed causally
    positions: torch.Tensor | None  # None with the mask: cached, cached + 1, ...
    logits_rows: list[int]  # the rows scored: the root, the tree after the root, then the side rows asked for

    def kept(self, path: list[int]) -> list[int]:
        """The rows the target's cache keeps: the committed tokens through the root, then the accepted nodes."""
        u = self.uncached
        return [*range(u), *(u - 1 + self.side + i for i in path[1:])]


def device_layout(cache_len: int, uncached: int, tree: DeviceTree) -> tuple[torch.Tensor, torch.Tensor]:
    """layout() without a side branch for a tree whose shape is on the device: built there, nothing read."""
    c, u, device = cache_len, uncached, tree.tokens.device
    q = u + len(tree) - 1
    mask = torch.ones(q, c + q, dtype=torch.bool, device=device)
    mask[:u, c:] = torch.ones(u, q, dtype=torch.bool, device=device).tril()  # committed: causal, no tree
    mask[u:, c + u:] = tree.ancestor_mask()[1:, 1:]
    return mask, torch.cat([torch.arange(c, c + u, device=device), tree.depths[1:] + (c + u - 1)])


def feed(cached: int, sequence: Sequence[int], proposal: Proposal) -> Feed:
    """Lay out the target's input for `proposal` after the `cached` committed tokens of `sequence`."""
    tree, side = proposal.tree, proposal.side
    uncached = list(sequence[cached:])
    on_device = isinstance(tree, DeviceTree)
    if uncached[-1] != (tree.root if on_device else tree.tokens[0]):
        raise ValueError("the proposal's root must be the last committed token")
    u, n = len(uncached), len(tree)
    side_tokens = side.tokens if side is not None else []
    s = len(side_tokens)
    mask = positions = None
    if on_device and isinstance(tree.parents, torch.Tensor):
        if side is not None:
            raise ValueError("a side branch beside a tree whose shape is on the device")
        mask, positions = device_layout(cached, u, tree)
    elif side is not None or not tree.is_chain():
        mask, positions = layout(cached, u, tree, side)
    # The tree's rows first, so that its logits are a view of the forward's, not a copy (a side branch's
    # rows, a copy, cost 0.1-0.2 ms a step: a row is the whole vocabulary)
    side_rows = [u + r for r in side.rows] if side is not None else []
    tokens = (torch.cat([to_device(uncached + side_tokens, tree.tokens.device, torch.long), tree.tokens[1:]])
              if on_device else uncached + side_tokens + tree.tokens[1:])
    return Feed(tokens, cached, u, s, mask, positions, [u - 1, *range(u + s, u + s + n - 1), *side_rows])


def split(proposal: Proposal, logits: torch.Tensor, extra: torch.Tensor | None, uncached: int,
          maxima: PanelMaxima | None = None) -> Scores:
    """The target's output for one prompt's feed (logits of feed.logits_rows; `extra`: the hidden
    state of the same rows, or the features of every fed row, as asked; `maxima`: the logits' panel
    maxima) as Scores."""
    side = proposal.side
    hidden = extra if proposal.hidden else None
    features = extra if proposal.feature_layers else None
    read = proposal.tree.read if isinstance(proposal.tree, DeviceTree) else None
    if side is None:
        return Scores(logits, None, hidden, features, top_k=proposal.top_k, read=read, maxima=maxima)
    n, s = len(proposal.tree), len(side.tokens)
    return Scores(logits[:n], logits[n:], hidden[:n] if hidden is not None else None,
                  torch.cat([features[:uncached], features[uncached + s:]]) if features is not None else None,
                  rows=logits, top_k=proposal.top_k, read=read, maxima=maxima)


def score(lm: LM, cache: KVCache, fed: Feed, proposal: Proposal) -> Scores:
    """One target forward over one prompt's feed (the single-prompt path: LM.forward)."""
    kwargs = {}
    if fed.mask is not None:
        kwargs["mask"], kwargs["position_ids"] = fed.mask, fed.positions
    if proposal.side is None:
        kwargs["logits_last"] = len(proposal.tree)  # the tree's rows are the last ones
    else:
        kwargs["logits_rows"] = fed.logits_rows
    out = lm.forward(fed.tokens, cache, hidden=proposal.hidden, features=proposal.feature_layers, **kwargs)
    logits, extra = out if proposal.hidden or proposal.feature_layers else (out, None)
    return split(proposal, logits, extra, fed.uncached, lm.maxima_of(logits))


def waits_for_prefill(proposer: Proposer) -> bool:
    return getattr(proposer, "waits_for_prefill", False)


def propose(proposer: Proposer, sequence: Sequence[int], room: int, prefill: bool) -> Proposal:
    """This step's proposal. At the prefill a proposer that waits for it is not asked: the root
    alone is scored, with the hidden state or features its later proposals read."""
    if prefill and waits_for_prefill(proposer):
        return Proposal(TokenTree.chain(sequence[-1], []), hidden=proposer.hidden,
                        feature_layers=proposer.feature_layers)
    return proposer.propose(sequence, room)


def settled(proposal: Proposal, scores: Scores | None = None) -> TokenTree:
    """The proposal's tree on the host. A DeviceTree is read, in verification's read where `scores` are
    given (one wait a step on a GPU), and becomes the proposal's tree."""
    tree = proposal.tree
    if isinstance(tree, DeviceTree):
        proposal.tree = tree = tree.settle(scores.argmax_rows().also() if scores is not None else tree.read.tolist())
    return tree


@dataclass
class Decoding:
    """One prompt being decoded: its proposer, how its drafts are accepted, and what it has
    committed. speculative_decode keeps one; batch.py one per row."""

    proposer: Proposer
    sampler: Sampler
    accept: Accept | None  # None: exact verification
    sequence: list[int]  # every committed token: the prompt, then the new ones
    max_new_tokens: int
    stop_ids: Collection[int]
    tokens: list[int] = field(default_factory=list)  # the new ones

    @property
    def room(self) -> int:
        """Drafts this step could still commit before its bonus token."""
        return self.max_new_tokens - len(self.tokens) - 1

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or self.tokens[-1] in self.stop_ids


def verify_and_commit(d: Decoding, proposal: Proposal, fed: Feed, scores: Scores,
                      timed: Callable[[], ContextManager]) -> tuple[dict, list[int]]:
    """Verify the proposal, append the step's tokens (the accepted path and the bonus, cut at a stop
    token and max_new_tokens) to `d`, let the proposer commit (its time counted by `timed`, as
    drafting); return the step's Step fields and the accepted path."""
    tree, prefill = settled(proposal, scores), not d.tokens
    path, bonus = (d.accept(tree, scores.logits, d.sampler) if d.accept is not None
                   else verify(proposal, scores, d.sampler))
    new = truncate_at_stop([tree.tokens[i] for i in path[1:]] + [bonus], d.stop_ids,
                           d.max_new_tokens - len(d.tokens))
    d.tokens += new
    d.sequence += new
    with timed():
        info = d.proposer.commit(proposal, scores, path, d.sequence)
    if prefill and waits_for_prefill(d.proposer):
        info = {}  # nothing was drafted
    return dict(committed=len(new), forward_tokens=len(fed.tokens), context_tokens=fed.cached,
                draft_tokens=len(tree) - 1, accepted_draft_tokens=min(len(path) - 1, len(new)),
                draft_forward_tokens=proposal.draft_forward_tokens, draft_flops=proposal.draft_flops,
                draft_prefill_flops=proposal.draft_prefill_flops, info=info), path


def speculative_decode(lm: LM, proposer: Proposer, prompt_ids: Sequence[int], max_new_tokens: int,
                       sampler: Sampler, stop_ids, *, accept: Accept | None = None) -> Generation:
    """Decode with `proposer`'s drafts, one target forward per step. `accept` replaces exact
    verification (Medusa's typical acceptance: lossy)."""
    tracer = new_tracer(lm.sync, lm.timing_event)
    cache = lm.new_cache(reserve=len(prompt_ids) + max_new_tokens + 64)  # and a step's tree, mostly
    d = Decoding(proposer, sampler, accept, list(prompt_ids), max_new_tokens, stop_ids)
    while True:
        with tracer.draft():
            proposal = propose(proposer, d.sequence, d.room, prefill=not d.tokens)
        # the prompt at the first step, then the last bonus token, and the drafts
        fed = feed(len(cache), d.sequence, proposal)
        with tracer.target():
            scores = score(lm, cache, fed, proposal)
        step, path = verify_and_commit(d, proposal, fed, scores, tracer.draft)
        tracer.end_step(**step)
        if d.done:
            return tracer.finish(d.tokens, stop_ids)
        cache.keep(list(range(fed.cached)) + [fed.cached + i for i in fed.kept(path)])
