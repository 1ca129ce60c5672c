"""The harness's KV cache on llama.cpp: which sequence ids each fed token takes, and the edits keep and crop.

llama.cpp has no attention mask to pass. A query at position p sees the cells that hold its first sequence
id at positions <= p (llama_kv_cache::set_input_kq_mask); a token may belong to several sequences. So a
tree is fed as llama.cpp's lookahead example feeds its window: each leaf is a sequence, and a node belongs
to the sequences of the leaves below it (the committed tokens fed with it, to all of them). A node's first
sequence then shows it exactly its ancestors, ordered by depth. Any mask that is such a forest maps; what
llama.cpp would apply is computed back from the sequences and compared with the mask asked for, so a mask
that is not a forest is refused in one line, never silently attended otherwise.

The cache's slots, in the harness's order: a prefix (positions 0, 1, ..., in sequence 0) and, past it, the
slots of the forwards since the last keep or crop, each with its position and sequences (never 0). A
sequence other than 0 also holds the prefix's first `synced` slots; it is brought up to date
(llama_memory_seq_cp) before a leaf takes it. keep() moves the kept chain into sequence 0 and drops every
other sequence past the prefix, which frees the cells no sequence holds.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Memory(Protocol):
    """llama.cpp's memory API on one context (llama_memory_seq_rm / _cp: positions p0 <= p < p1, -1 = open)."""

    def rm(self, seq: int, p0: int, p1: int) -> None: ...

    def cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...


class UnmappableMask(ValueError):
    """A mask that no assignment of llama.cpp sequence ids reproduces."""


class SequenceCache:
    """One generation's cache on a llama.cpp context's memory, `n_seq` sequence ids wide."""

    positions = None  # llama.cpp applies sliding windows itself, by the cells' positions

    def __init__(self, memory: Memory, n_seq: int):
        self.memory, self.n_seq = memory, n_seq
        self.prefix = 0
        self.synced = [0] * n_seq  # sequence s holds the prefix's first synced[s] slots (sequence 0: all)
        self.extra_pos: list[int] = []  # per slot past the prefix: its position
        self.extra_seqs: list[frozenset[int]] = []  # ... and its sequences

    def __len__(self) -> int:
        return self.prefix + len(self.extra_pos)

    # ---- a forward's sequences -------------------------------------------------------------
    def place(self, positions: np.ndarray | None, mask: np.ndarray | None, q: int) -> tuple[np.ndarray, list]:
        """The positions (q,) and sequence ids (a tuple per token, first the one it queries with) of `q` new
        tokens fed at `positions` (None: after the cache) under bool `mask` (q, len(self) + q; None: causal).
        Syncs the sequences the leaves take; the slots are recorded by added() once the forward ran."""
        n, cached = self.prefix, len(self)
        if mask is None:
            if self.extra_pos:
                raise UnmappableMask("a causal feed after a tree's slots: keep or crop the cache first")
            return np.arange(n, n + q, dtype=np.int32), [(0,)] * q
        mask = np.asarray(mask, dtype=bool)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if mask.shape != (q, cached + q) or pos.shape != (q,):
            raise UnmappableMask(f"mask {mask.shape} and positions {pos.shape} for {q} new tokens after {cached}")
        if not mask[:, :n].all():
            raise UnmappableMask("every fed token must see the whole committed prefix")
        new = mask[:, cached:]
        if not new.diagonal().all():
            raise UnmappableMask("every fed token must see itself")
        leaves = np.flatnonzero(new.sum(0) == 1)  # seen by no other fed token
        free = [s for s in range(1, self.n_seq) if all(s not in seqs for seqs in self.extra_seqs)]
        if len(leaves) > len(free):
            raise UnmappableMask(f"{len(leaves)} leaves, more than the {len(free)} free sequences of "
                                 f"n_seq_max {self.n_seq}")
        extra_seqs = list(self.extra_seqs)
        token_seqs: list[list[int]] = [[] for _ in range(q)]
        extra_pos = np.asarray(self.extra_pos, dtype=np.int64)
        for leaf, s in zip(leaves, free):
            if self.synced[s] < n:
                self.memory.cp(0, s, self.synced[s], -1)  # sequence 0 holds the prefix only
                self.synced[s] = n
            hang = np.flatnonzero(mask[leaf, n:cached])  # slots of earlier forwards it sees
            if len(hang):
                top = hang[np.argmax(extra_pos[hang])]
                src, upto = min(extra_seqs[top]), int(extra_pos[top])
                self.memory.cp(src, s, n, upto + 1)  # the branch it hangs from, up to its last slot
                for e, seqs in enumerate(extra_seqs):
                    if src in seqs and extra_pos[e] <= upto:
                        extra_seqs[e] = seqs | {s}
            for t in np.flatnonzero(new[leaf]):
                token_seqs[t].append(int(s))
        if any(not seqs for seqs in token_seqs):
            raise UnmappableMask("a fed token that no leaf sees: the mask is not a forest")
        self._check(mask[:, n:], extra_seqs, pos, token_seqs)
        self._pending = extra_seqs
        return pos.astype(np.int32), [tuple(seqs) for seqs in token_seqs]

    def _check(self, mask: np.ndarray, extra_seqs: list, pos: np.ndarray, token_seqs: list) -> None:
        """The mask llama.cpp will apply (a query sees the slots holding its first sequence at positions up
        to its own) against the one asked for, over the slots past the prefix."""
        slot_pos = np.concatenate([np.asarray(self.extra_pos, dtype=np.int64), pos])
        holds = np.zeros((len(slot_pos), self.n_seq), dtype=bool)
        for i, seqs in enumerate([*extra_seqs, *token_seqs]):
            holds[i, list(seqs)] = True
        first = np.array([seqs[0] for seqs in token_seqs])
        applied = holds[:, first].T & (slot_pos[None, :] <= pos[:, None])
        if not np.array_equal(applied, mask):
            row = int(np.flatnonzero((applied != mask).any(1))[0])
            raise UnmappableMask(f"fed token {row} at position {int(pos[row])}: its mask is not a forest ordered by "
                                 "position, so no llama.cpp sequence ids reproduce it")

    def added(self, positions: np.ndarray, seqs: list) -> None:
        """The forward that place() laid out ran: its tokens are the cache's newest slots."""
        if seqs and seqs[0] == (0,):  # causal, after the prefix
            self.prefix += len(seqs)
            return
        self.extra_seqs = [*self._pending, *(frozenset(s) for s in seqs)]
        self.extra_pos += [int(p) for p in positions]

    # ---- edits -----------------------------------------------------------------------------
    def crop(self, length: int) -> None:
        """Keep the first `length` slots."""
        self.keep(range(length))

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only the slots `indices` (ascending): the prefix's first ones, then a chain of slots past it
        whose positions continue the prefix's (the committed tokens and a tree's accepted path)."""
        indices = [int(i) for i in indices]
        n = self.prefix
        m = 0
        while m < len(indices) and m < n and indices[m] == m:
            m += 1
        chain = [i - n for i in indices[m:]]
        if chain and (m < n or min(chain) < 0 or chain != sorted(set(chain)) or chain[-1] >= len(self.extra_pos)):
            raise ValueError(f"cannot keep slots {indices[:8]}... of a cache of {len(self)}: the prefix's first "
                             "slots, then slots past it, ascending")
        if chain:
            if [self.extra_pos[e] for e in chain] != list(range(n, n + len(chain))):
                raise ValueError("the slots kept past the prefix must continue its positions one by one")
            src = min(self.extra_seqs[chain[-1]])
            held = [e for e, seqs in enumerate(self.extra_seqs) if src in seqs and self.extra_pos[e] < n + len(chain)]
            if held != chain:
                raise ValueError("the slots kept past the prefix are not one branch of the tree fed")
            self.memory.cp(src, 0, n, n + len(chain))
        busy = {s for seqs in self.extra_seqs for s in seqs}
        end = n if chain else m  # where sequences other than 0 end
        for s in range(1, self.n_seq):
            if s in busy or self.synced[s] > end:
                self.memory.rm(s, end, -1)
                self.synced[s] = min(self.synced[s], end)
        if not chain and m < n:
            self.memory.rm(0, m, -1)
        self.prefix = n + len(chain) if chain else m
        self.extra_pos, self.extra_seqs = [], []
