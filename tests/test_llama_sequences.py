"""The mask -> llama.cpp sequence ids mapping (decoders/core/llama_sequences.py), against a model of llama.cpp's
unified KV cells: its memory API's edits, its batch checks and the mask it applies (a query sees the cells
holding its first sequence at positions up to its own). Every layout the harness feeds: a tree after
uncached committed tokens, lookahead's window beside one, a draft's tree fed level by level, causal chains;
keep and crop leave sequence 0 holding exactly the committed tokens. The engine itself: tests/test_llamacpp.py."""
import random

import numpy as np
import pytest
import torch

from decoders.core.llama_sequences import SequenceCache, UnmappableMask
from decoders.core.kv_cache import level_mask
from decoders.core.loop import SideBranch, layout
from decoders.core.tree import TokenTree, ancestors
from decoders.methods.lookahead import window_mask

N_SEQ = 64


class Cells:
    """llama.cpp's unified KV cache as its memory API and llama_decode see it: cells of a position and the
    sequences holding it (a cell no sequence holds is freed)."""

    def __init__(self):
        self.cells: dict[int, tuple[int, set]] = {}  # cell id -> (position, sequences)
        self.next = 0

    def rm(self, seq, p0, p1):
        hi = p1 if p1 >= 0 else 1 << 30
        for cid, (pos, seqs) in list(self.cells.items()):
            if seq in seqs and max(p0, 0) <= pos < hi:
                seqs.discard(seq)
                if not seqs:
                    del self.cells[cid]

    def cp(self, src, dst, p0, p1):
        hi = p1 if p1 >= 0 else 1 << 30
        for pos, seqs in self.cells.values():
            if src in seqs and max(p0, 0) <= pos < hi:
                seqs.add(dst)

    def seq_max(self, s):
        return max((p for p, seqs in self.cells.values() if s in seqs), default=-1)

    def decode(self, positions, seq_lists) -> list[set[int]]:
        """Adds the batch's cells, after llama_batch_allocr's checks; returns each query's visible cell ids."""
        by_seq: dict[int, list[int]] = {}
        for p, seqs in zip(positions, seq_lists):
            for s in seqs:
                by_seq.setdefault(s, []).append(int(p))
        for s, ps in by_seq.items():
            assert ps == sorted(ps), f"sequence {s} positions decrease"
            assert min(ps) == self.seq_max(s) + 1, f"sequence {s}: batch starts at {min(ps)}, memory ends at " \
                                                   f"{self.seq_max(s)}"
            assert max(ps) - min(ps) + 1 == len(set(ps)), f"sequence {s} positions are not continuous"
        for seqs in seq_lists:  # coupled sequences must agree in memory
            assert len({self.seq_max(s) for s in seqs}) == 1, f"coupled sequences {seqs} have diverged"
        ids = []
        for p, seqs in zip(positions, seq_lists):
            self.cells[self.next] = (int(p), set(seqs))
            ids.append(self.next)
            self.next += 1
        return [{cid for cid, (cp, cs) in self.cells.items() if seqs[0] in cs and cp <= p}
                for p, seqs in zip(positions, seq_lists)]


class Harness:
    """A SequenceCache on Cells, with the harness's slots mirrored as cell ids to check what each query saw."""

    def __init__(self):
        self.cells = Cells()
        self.cache = SequenceCache(self.cells, N_SEQ)
        self.slots: list[int] = []  # the cache's slots, in its order: cell ids

    def feed(self, q, positions=None, mask=None):
        pos, seqs = self.cache.place(positions, None if mask is None else np.asarray(mask), q)
        seen = self.cells.decode(pos, seqs)
        self.cache.added(pos, seqs)
        ids = sorted(self.cells.cells)[-q:]
        if mask is not None:
            all_slots = self.slots + ids
            for row, visible in enumerate(seen):
                asked = {all_slots[j] for j in np.flatnonzero(np.asarray(mask)[row])}
                assert visible == asked, f"row {row} sees {sorted(visible)}, asked {sorted(asked)}"
        self.slots += ids

    def keep(self, indices):
        self.cache.keep(indices)
        self.slots = [self.slots[i] for i in indices]
        self.check_committed()

    def check_committed(self):
        """Sequence 0 holds the cache's slots at positions 0, 1, ...; every cell is one of them."""
        n = len(self.cache)
        assert set(self.cells.cells) == set(self.slots)
        assert sorted(p for p, s in self.cells.cells.values() if 0 in s) == list(range(n))
        for s in range(1, N_SEQ):  # another sequence holds a prefix of them
            held = sorted(p for p, seqs in self.cells.cells.values() if s in seqs)
            assert held == list(range(len(held)))


def random_tree(rng: random.Random, nodes: int) -> TokenTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, nodes)]
    return TokenTree(tokens=list(range(nodes)), parents=parents)


def below_root(tree: TokenTree, node: int) -> list[int]:
    """The path from the root's child down to `node` (empty for the root)."""
    return [*reversed(ancestors(tree.parents, node)), node] if node else []


def tree_step(h: Harness, uncached: int, tree: TokenTree, side: SideBranch | None, rng: random.Random):
    """One target step as the loop lays it out, then keeps a random accepted path."""
    cached = len(h.cache)
    mask, positions = layout(cached, uncached, tree, side)
    h.feed(mask.shape[0], positions.numpy(), mask.numpy())
    path = [0, *below_root(tree, rng.randrange(len(tree)))]
    path = path[:rng.randint(1, len(path))]
    s = len(side.tokens) if side is not None else 0
    h.keep(list(range(cached)) + list(range(cached, cached + uncached)) +
           [cached + uncached - 1 + s + i for i in path[1:]])


@pytest.mark.parametrize("seed", range(6))
def test_tree_steps_attend_as_their_masks_say(seed):
    rng = random.Random(seed)
    h = Harness()
    h.feed(7)  # a prompt, causal
    h.keep(range(7))
    uncached = 1
    for _ in range(12):
        tree_step(h, uncached, random_tree(rng, rng.randint(1, 24)), None, rng)
        uncached = 1


@pytest.mark.parametrize("levels,width", [(1, 1), (2, 3), (3, 5), (4, 4)])
def test_lookahead_window_beside_a_tree(levels, width):
    rng = random.Random(levels * 10 + width)
    h = Harness()
    h.feed(5)
    offsets = torch.tensor([1 + j + k for k in range(levels) for j in range(width)])
    for _ in range(6):
        side = SideBranch(tokens=[0] * (levels * width), mask=window_mask(levels, width), offsets=offsets, rows=[])
        tree_step(h, 1, random_tree(rng, rng.randint(1, 8)), side, rng)


def test_prefill_fused_with_a_tree():
    rng = random.Random(3)
    h = Harness()
    tree_step(h, 9, random_tree(rng, 12), None, rng)  # the prompt's tokens are the uncached committed ones
    tree_step(h, 1, random_tree(rng, 12), None, rng)


@pytest.mark.parametrize("seed", range(4))
def test_a_draft_tree_fed_level_by_level(seed):
    """draft_tree's feeds: the committed tokens causally, then each level's inner nodes, each seeing the
    context and its fed ancestors (cached slots past the prefix); then the accepted path's fed nodes are kept."""
    rng = random.Random(seed)
    h = Harness()
    h.feed(6)
    for _ in range(5):
        root_pos = len(h.cache) - 1
        tree = random_tree(rng, rng.randint(2, 20))
        kids = [[c for c in range(len(tree)) if tree.parents[c] == n] for n in range(len(tree))]
        slot, frontier = {0: root_pos}, [0]
        while True:
            level = [c for n in frontier for c in kids[n] if kids[c]]
            if not level:
                break
            base = len(h.cache)
            mask = level_mask(base, root_pos + 1, [[slot[a] for a in ancestors(tree.parents, n)] for n in level])
            h.feed(len(level), np.array([root_pos + tree.depths[n] for n in level]), mask.numpy())
            slot.update((n, base + r) for r, n in enumerate(level))
            frontier = level
        path = [n for n in below_root(tree, rng.randrange(len(tree))) if n in slot]
        path = path[:rng.randint(0, len(path))]
        h.keep(list(range(root_pos + 1)) + [slot[n] for n in path])
        h.feed(rng.randint(1, 3))  # the step's committed tokens the draft has not read
        h.keep(range(len(h.cache)))


def test_chains_crop_back():
    h = Harness()
    h.feed(5)
    h.feed(4)  # spec_chain's drafts, causal
    h.keep(range(7))
    assert len(h.cache) == 7
    q = 3  # a causal feed at explicit positions (the profiler's), cut back after
    mask = np.tril(np.ones((q, 7 + q), bool), 7)
    h.feed(q, np.arange(7, 10), mask)
    h.cache.crop(7)
    h.slots = h.slots[:7]
    h.check_committed()
    h.cache.crop(2)
    h.slots = h.slots[:2]
    h.check_committed()


def test_a_mask_that_is_not_a_forest_is_refused():
    """Negative control: token 2 sees 0 and 1, which do not see each other; no sequence ids say that."""
    h = Harness()
    h.feed(3)
    mask = np.ones((3, 6), bool)
    mask[:, 3:] = [[1, 0, 0], [0, 1, 0], [1, 1, 1]]
    with pytest.raises(UnmappableMask, match="forest"):
        h.cache.place(np.array([3, 3, 4]), mask, 3)
    hidden = np.ones((2, 5), bool)
    hidden[1, 1] = False  # a token that does not see the whole committed prefix
    with pytest.raises(UnmappableMask, match="prefix"):
        h.cache.place(np.array([3, 4]), hidden, 2)
