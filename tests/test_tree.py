import pytest
import torch

from decoders import TokenTree
from decoders.core.loop import layout


def test_chain_tree():
    tree = TokenTree.chain(5, [6, 7, 8])
    assert tree.parents == [-1, 0, 1, 2]
    assert tree.depths == [0, 1, 2, 3]
    assert tree.path(3) == [0, 1, 2, 3]
    assert torch.equal(tree.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_branching_tree_mask_positions_paths():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    tree = TokenTree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2])
    assert tree.depths == [0, 1, 1, 2, 2, 2]
    assert tree.children == [[1, 2], [3, 4], [5], [], [], []]
    assert tree.leaves() == [3, 4, 5]
    assert tree.path(4) == [0, 1, 4]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    full, positions = layout(3, 1, tree)  # the root uncached after 3 cached tokens, then the tree
    assert full.shape == (6, 9) and full[:, :3].all() and torch.equal(full[:, 3:], expected)
    assert positions.tolist() == [3, 4, 4, 5, 5, 5]


def test_from_sequences_merges_shared_prefixes():
    tree = TokenTree.from_sequences(1, [[2, 3, 4], [2, 3, 5], [6], [2, 7]])
    assert tree.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert tree.parents == [-1, 0, 1, 2, 2, 0, 1]
    assert sorted(tuple(tree.tokens[i] for i in tree.path(leaf)) for leaf in tree.leaves()) == \
        [(1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 7), (1, 6)]


@pytest.mark.parametrize("tokens,parents,message", [
    ([1, 2], [0, 0], "root"),
    ([1, 2, 3], [-1, 2, 0], "precede"),
    ([1, 2], [-1], "one parent per token"),
    ([], [], "one parent per token"),
])
def test_invalid_trees(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens, parents)


def test_ancestor_mask_equals_the_row_by_row_definition_on_random_trees():
    """ancestor_mask is filled in Python and made a tensor once; against the definition (a node's row
    is its parent's row plus itself) on random trees of 1-80 nodes."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 80)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        expected = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            expected[i, i] = True
            if parents[i] >= 0:
                expected[i] |= expected[parents[i]]
        got = TokenTree(list(range(n)), parents).ancestor_mask()
        assert got.dtype == torch.bool and torch.equal(got, expected), parents
