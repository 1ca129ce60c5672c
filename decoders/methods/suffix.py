"""SuffixDecoding (Oliaro et al., NeurIPS 2025, arXiv 2411.04975): model-free drafts from suffix
tries over text seen before, with counts.

Two tries are searched each step: the request's own (its prompt and its output so far) and, with
`use_global`, one over earlier requests' finished outputs (kept per target between prompts, as
recycling keeps its table). In each, the node of every suffix of the context (its last p tokens,
p = 1 .. max_depth - 1) is a candidate; from it a speculation tree is grown best-first: always the
continuation whose path probability (the product of count / parent count along it: how often the
text went on that way) is highest, while it is at least `min_token_prob`, up to alpha * p nodes
(MAX_SPEC: a longer match earns a bigger tree) and `max_spec_tokens`. Of all candidates the tree of
the highest score (the sum of its nodes' path probabilities: its expected accepted tokens under
those frequencies) is verified. Candidates are deterministic, so greedy is exact and sampling uses
deterministic-candidate verification (the target's distribution is kept).

The trie stores every suffix cut to `max_depth` tokens, so a match of p tokens drafts at most
max_depth - p deep. Costs, with D = max_depth and a tree of at most M nodes: appending a token
O(D) (one child step for each of the last D suffixes); the request's trie over an L-token prompt
O(L D) time and at most L D nodes; the global trie O(D) per output token, at most D nodes each;
matching O(D) in the request's trie (its open suffixes are the matches) and O(D^2) in the global
one; growing one tree O(M log M) plus its nodes' children; at most 2 (D - 1) candidates, longest
match first, stopping once no smaller tree (alpha * p nodes) can outscore the best so far.
The global trie holds the last `max_cached_requests` outputs (the authors' bound, their default
10,000 in vLLM: past it the oldest output is evicted, first in first out): up to D nodes, a few
KB in CPython, per output token it holds. Evicting an output takes off exactly what learning it
added, in O(D) per token (its suffixes' counts fall by one; a node left at count 0 is unlinked and
its slot reused), so the trie is then the trie of the outputs kept.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from ..core.contract import PerTarget, check, check_step, decode_one
from ..core.lm import LM
from ..core.loop import Proposal, Scores
from ..core.sampling import Sampler
from ..core.tree import TokenTree


class SuffixTrie:
    """Every suffix of the stored sequences, cut to `max_depth` tokens, as a trie. A node is the
    string on its path; its count is how many positions of the stored sequences that string starts
    at (an occurrence at a sequence's end, with nothing after it yet, included), so a child's count
    over its parent's is how often the string went on with the child's token.

    With `max_sequences` (the global trie), whole sequences stored by `add` are kept, oldest first,
    and the oldest is evicted (`remove`) before one more would exceed it."""

    def __init__(self, max_depth: int, max_sequences: int | None = None):
        self.max_depth, self.max_sequences = max_depth, max_sequences
        self.count: list[int] = [0]  # per node; the root's: tokens stored
        self.kids: list[dict[int, int] | None] = [None]  # per node: token -> child node (None: no child yet)
        self.free: list[int] = []  # slots of evicted nodes, reused before new ones
        self.sequences = 0  # sequences begun (the global trie: outputs learnt)
        self.evicted = 0  # sequences evicted (the global trie: outputs it no longer holds)
        self.stored: deque[list[int]] = deque()  # with max_sequences: the sequences held, oldest first

    def __len__(self) -> int:
        """Nodes held, the root included (evicted ones' slots left for reuse are not)."""
        return len(self.count) - len(self.free)

    def __deepcopy__(self, memo) -> "SuffixTrie":
        """A copy in one pass over flat lists (contract.carried_copy takes one per timed repeat)."""
        other = SuffixTrie(self.max_depth, self.max_sequences)
        other.count = list(self.count)
        other.kids = [None if k is None else dict(k) for k in self.kids]
        other.free = list(self.free)
        other.sequences, other.evicted = self.sequences, self.evicted
        other.stored = deque(list(s) for s in self.stored)
        return other

    def child(self, node: int, token: int) -> int | None:
        kids = self.kids[node]
        return None if kids is None else kids.get(token)

    def _step(self, node: int, token: int) -> int:
        """The child of `node` for `token`, made if new, its count raised by one."""
        kids = self.kids[node]
        if kids is None:
            kids = self.kids[node] = {}
        child = kids.get(token)
        if child is None:
            if self.free:
                child = kids[token] = self.free.pop()  # an evicted node's slot: count 0, no children
            else:
                child = kids[token] = len(self.count)
                self.count.append(0)
                self.kids.append(None)
        self.count[child] += 1
        return child

    def extend(self, open_: list[int], tokens: Sequence[int]) -> list[int]:
        """Append `tokens` to a sequence whose open suffixes (those that can still grow: shorter
        than max_depth) end at the nodes `open_`, shortest first; returns them after the append.
        A new sequence starts with open_ = []."""
        keep = self.max_depth - 1
        for token in tokens:
            token = int(token)
            self.count[0] += 1
            open_ = [self._step(node, token) for node in (0, *open_[:keep])]
        return open_[:keep]

    def add(self, tokens: Sequence[int]) -> None:
        """Store one whole sequence (a finished output); with max_sequences, first evict the oldest
        stored ones until this one fits."""
        tokens = [int(t) for t in tokens]
        if self.max_sequences is not None:
            while len(self.stored) >= self.max_sequences:
                self.remove(self.stored.popleft())
            self.stored.append(tokens)
        self.sequences += 1
        self.extend([], tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take off one stored sequence: the counts `add` raised, each lowered by one. A node left at
        count 0 (no stored string goes through it any more, nor through its children, whose counts are
        at most its own) is unlinked from its parent and its slot kept for reuse."""
        tokens = [int(t) for t in tokens]
        self.evicted += 1
        for start in range(len(tokens)):
            self.count[0] -= 1
            node = 0
            for token in tokens[start:start + self.max_depth]:
                kids = self.kids[node]
                child = kids[token]
                self.count[child] -= 1
                if self.count[child] == 0:
                    del kids[token]
                    if not kids:
                        self.kids[node] = None
                    self.free.append(child)
                node = child

    def matches(self, context: Sequence[int]) -> list[int]:
        """The nodes of the context's suffixes found here, by length: [last 1 token, last 2, ...],
        up to max_depth - 1 tokens (a node at max_depth has nothing after it), stopping at the first
        missing one (every suffix of a stored string is stored)."""
        tail = [int(t) for t in context[-(self.max_depth - 1):]]
        found = []
        for p in range(1, len(tail) + 1):
            node = 0
            for token in tail[-p:]:
                node = self.child(node, token)
                if node is None:
                    return found
            found.append(node)
        return found


@dataclass
class Draft:
    """One candidate speculation tree: its nodes after the root, best-first."""

    tokens: list[int]
    parents: list[int]  # per node, its parent's index in the tree (0: the root)
    probs: list[float]  # per node, its path probability
    match: int = 0  # p: the context's last p tokens matched
    source: str = ""  # "request" or "global"

    @property
    def score(self) -> float:
        return sum(self.probs)


def grow(trie: SuffixTrie, node: int, size: int, depth: int, min_prob: float, stop_ids) -> Draft:
    """The speculation tree after `node`, grown best-first: each time the candidate of highest
    path probability (count / parent count, multiplied along the path) joins, until `size` nodes,
    or none of at least `min_prob` is left. At most `depth` deep; nothing is drafted past a stop
    token. Path probabilities only fall along a path, so a parent always joins before its children."""
    draft = Draft([], [], [])
    heap: list[tuple[float, int, int, int, int, int]] = []  # (-prob, order, token, trie node, parent, depth)
    order = itertools.count()  # ties: the first pushed first

    def push_children(at: int, prob: float, parent: int, level: int) -> None:
        kids = trie.kids[at]
        if kids is None or level >= depth:
            return
        total = trie.count[at]
        for token, child in kids.items():
            p = prob * trie.count[child] / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, next(order), token, child, parent, level + 1))

    push_children(node, 1.0, 0, 0)
    while heap and len(draft.tokens) < size:
        neg, _, token, child, parent, level = heapq.heappop(heap)
        draft.tokens.append(token)
        draft.parents.append(parent)
        draft.probs.append(-neg)
        if token not in stop_ids:
            push_children(child, -neg, len(draft.tokens), level)
    return draft


def best_draft(candidates: Sequence[tuple[str, SuffixTrie, list[int]]], alpha: float, max_spec_tokens: int,
               depth: int, min_prob: float, stop_ids) -> Draft:
    """Of the trees grown from every matched suffix of every trie (source, trie, matched nodes by
    length), the highest-scoring one; ties go to the earlier trie and the longer match. A match of p
    tokens grows at most min(max_spec_tokens, alpha * p) nodes, which is also the most it can score:
    matches are tried longest first, and a trie's shorter ones are skipped once that bound is beaten."""
    best = Draft([], [], [])
    for source, trie, matched in candidates:
        for p in range(len(matched), 0, -1):
            size = min(max_spec_tokens, int(alpha * p + 1e-9))
            if size <= best.score:
                break
            draft = grow(trie, matched[p - 1], size, depth, min_prob, stop_ids)
            if draft.score > best.score:
                best = draft
                best.match, best.source = p, source
    return best


class SuffixDraft:
    """The proposer: the request's trie, grown from the committed tokens as they come, and the
    global trie (None without use_global), which learns this output once it is finished."""

    waits_for_prefill = False  # the prompt is text to draft from already

    def __init__(self, settings: "Suffix", global_trie: SuffixTrie | None, prompt_len: int, stop_ids):
        self.settings, self.global_trie, self.prompt_len, self.stop_ids = settings, global_trie, prompt_len, stop_ids
        self.request = SuffixTrie(settings.max_depth)
        self.open: list[int] = []  # the request trie's nodes of the context's suffixes (matches), shortest first
        self.seen = 0  # committed tokens in the request trie
        self.end = 0  # the sequence length at which max_new_tokens ends this generation (set by propose)
        self.draft = Draft([], [], [])  # this step's, for commit()

    def propose(self, sequence: Sequence[int], room: int) -> Proposal:
        self.end = len(sequence) + room + 1
        self.open = self.request.extend(self.open, sequence[self.seen:])
        self.seen = len(sequence)
        s = self.settings
        candidates = [("request", self.request, self.open)]
        if self.global_trie is not None:
            candidates.append(("global", self.global_trie, self.global_trie.matches(sequence)))
        self.draft = (best_draft(candidates, s.alpha, s.max_spec_tokens, room, s.min_token_prob, self.stop_ids)
                      if room > 0 else Draft([], [], []))
        return Proposal(TokenTree([int(sequence[-1]), *self.draft.tokens], [-1, *self.draft.parents]))

    def commit(self, proposal: Proposal, scores: Scores, path: list[int], sequence: Sequence[int]) -> dict:
        finished = len(sequence) >= self.end or sequence[-1] in self.stop_ids
        if finished and self.global_trie is not None:
            self.global_trie.add(sequence[self.prompt_len:])  # the output, for the prompts after this one
        tree = proposal.tree
        return {"draft_depth": max(tree.depths), "accepted_depth": len(path) - 1, "tree_size": len(tree),
                "match_length": self.draft.match, "from_global": self.draft.source == "global"}


def _check_number(key: str, value, low: float, high: float | None, low_open: bool) -> None:
    """One ValueError naming decoder.<key> unless `value` is a number in range (low excluded when low_open)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and (value > low if low_open else value >= low) and (high is None or value <= high))
    if not ok:
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValueError(f"decoder.{key} must be a number {bound}{'' if high is None else f' and <= {high}'}, "
                         f"got {value!r}")


@dataclass
class Suffix:
    name: str | None = None  # set by its conf/decoder/<name>.yaml, the one place a method is named
    lossless: bool = True
    alpha: float = 1.0  # MAX_SPEC = alpha * p: a match of p tokens drafts at most that many nodes
    max_spec_tokens: int = 24  # draft nodes per step at most, whatever the match
    min_token_prob: float = 0.1  # a node joins only if its path probability is at least this
    max_depth: int = 24  # stored suffixes are cut to this many tokens: match + draft depth <= max_depth
    use_global: bool = True  # also draft from earlier requests' outputs (a trie kept per target)
    max_cached_requests: int | None = 10000  # outputs the global trie holds, the oldest evicted past it; None: no bound

    def __post_init__(self):
        _check_number("alpha", self.alpha, 0, None, low_open=True)
        _check_number("min_token_prob", self.min_token_prob, 0, 1, low_open=False)
        check("max_spec_tokens", self.max_spec_tokens, at_least=1)
        check("max_depth", self.max_depth, at_least=2)
        check("use_global", self.use_global, one_of=(True, False))
        check("max_cached_requests", self.max_cached_requests, at_least=1, also=(None,))
        self.widest_step = check_step(1 + self.max_spec_tokens, f"1 + max_spec_tokens {self.max_spec_tokens}")
        self._carried: PerTarget[dict] = PerTarget()  # per target: {"global": the trie of earlier outputs}

    def carried(self, lm: LM) -> dict:
        """What is carried between lm's prompts (contract.CarriesState): the global trie; nothing
        without use_global. Warm-ups and timed repeats put it back as it was, so no run drafts from
        its own earlier decoding of the same prompt."""
        return self._carried.get(lm, dict) if self.use_global else {}

    def global_trie(self, lm: LM) -> SuffixTrie | None:
        if not self.use_global:
            return None
        return self.carried(lm).setdefault("global", SuffixTrie(self.max_depth, self.max_cached_requests))

    def proposer(self, lm: LM, prompt_ids, sampler: Sampler, stop_ids):
        """Rows of one batch share the global trie (a row's output joins it when the row finishes):
        lossless, but their drafts then differ from one prompt at a time."""
        return SuffixDraft(self, self.global_trie(lm), len(prompt_ids), stop_ids), None

    generate = decode_one  # one prompt through the shared loop
