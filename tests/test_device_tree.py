"""A drafted tree kept on the device until verification reads it (tree.DeviceTree): the path a GPU takes,
where each read makes the host wait, run here by turning transfer.reads_wait on. The target's input
built on the device is the host layout's, decoding through it is autoregressive greedy's token for
token with the same trees step by step, and on a GPU a step waits once (test_device_placement.py).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import decoders.core.transfer as transfer
from decoders.core.loop import feed, propose, score, settled
from decoders.core.sampling import Sampling
from decoders.core.tree import DeviceTree, TokenTree
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.draft_model import SelfDraft
from decoders.methods.eagle import Eagle
from decoders.methods.medusa import Medusa
from decoders.methods.sequoia import Sequoia
from decoders.methods.spec_chain import SpecChain
from decoders.methods.specinfer import SpecInfer
from helpers import tiny_lm

GREEDY = Sampling()
DECODERS = {  # each built anew per test: a decoder keeps its draft, and Sequoia its tree, per target
    "eagle-dynamic-10-3-4": lambda: Eagle(draft_weights=None, draft_seed=1, tree_size=10, depth=3, top_k=4),
    "eagle-dynamic-40-8-3": lambda: Eagle(draft_weights=None, draft_seed=3, tree_size=40, depth=8, top_k=3),
    "eagle-dynamic-1-1-1": lambda: Eagle(draft_weights=None, draft_seed=2, tree_size=1, depth=1, top_k=1),
    "eagle-static-16-4-4": lambda: Eagle(draft_weights=None, draft_seed=4, tree="static", tree_size=16, depth=4,
                                         top_k=4),
    "eagle-static-5-5-1": lambda: Eagle(draft_weights=None, draft_seed=5, tree="static", tree_size=5, depth=5, top_k=1),
    "spec_chain-4": lambda: SpecChain(draft=SelfDraft(layers=1), depth=4),
    "sequoia-8-4": lambda: Sequoia(draft=SelfDraft(layers=1), budget=8, depth=4, auto_tokens=16),
    "medusa-list-seed2": lambda: Medusa(choices=[[0], [1], [0, 0], [2], [0, 1], [0, 0, 0]], num_heads=3, heads_seed=2),
    "medusa-chain-seed1": lambda: Medusa(choices="chain", heads_seed=1),
    # its trie merges equal draws, so its tokens are read at once (tree.host_tokens), on the device path too
    "specinfer-2x3": lambda: SpecInfer(draft=SelfDraft(layers=1), num_drafts=2, depth=3),
}
READ_AT_ONCE = {"specinfer-2x3"}


@pytest.fixture
def reads_wait(monkeypatch):
    """transfer.reads_wait on for every device; returns the list of trees settled from the device."""
    settled_trees: list[TokenTree] = []
    monkeypatch.setattr(transfer, "reads_wait", lambda device: True)
    real = DeviceTree.__init__

    def counted(self, *args, **kwargs):
        real(self, *args, **kwargs)
        settle = self.settle
        self.settle = lambda values: settled_trees.append(settle(values)) or settled_trees[-1]
    monkeypatch.setattr(DeviceTree, "__init__", counted)
    return settled_trees


def trees_of(gen) -> list[tuple]:
    return [(s.draft_tokens, s.accepted_draft_tokens, s.committed) for s in gen.steps]


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("seed", range(3))
def test_a_tree_read_with_verification_decodes_as_autoregressive(name, seed, reads_wait, monkeypatch):
    """Drafts kept on the device (EAGLE's dynamic and static trees, a draft model's chain, Sequoia's tree
    and Medusa's heads' top-k): autoregressive greedy's tokens, and each step drafts and accepts what the
    path that reads at once does (the same trees)."""
    lm = tiny_lm(seed=seed)
    prompt = [(7 * seed + 3 * i) % 64 for i in range(5)] * 3  # repeats: drafts get accepted
    reference = autoregressive_decode(lm, prompt, 30, GREEDY, stop_ids=set()).tokens
    decoder = DECODERS[name]()
    out = decoder.generate(lm, prompt, 30, GREEDY, set())
    assert bool(reads_wait) != (name in READ_AT_ONCE), "the test ran another path than it names"
    assert out.tokens == reference
    monkeypatch.setattr(transfer, "reads_wait", lambda device: False)
    assert trees_of(out) == trees_of(decoder.generate(lm, prompt, 30, GREEDY, set()))


def device_proposal(tree: str, seed: int = 1):
    """A deferred EAGLE proposal of a few depths after a prefill, with the sequence it extends."""
    lm = tiny_lm(seed=seed)
    shape = [[0], [1], [0, 0], [0, 1], [0, 0, 0], [1, 0], [0, 0, 0, 0]] if tree == "static" else tree  # rank paths
    eagle = Eagle(draft_weights=None, draft_seed=seed, tree=shape, tree_size=12, depth=4, top_k=2)
    proposer = eagle.proposer(lm, [3, 9, 4, 1], None, set())[0]
    sequence = [3, 9, 4, 1]
    first = propose(proposer, sequence, 10, prefill=True)
    scores = score(lm, lm.new_cache(), feed(0, sequence, first), first)
    sequence.append(int(scores.logits[0].argmax()))
    proposer.commit(first, scores, [0], sequence)
    return lm, proposer.propose(sequence, 10), sequence


@pytest.mark.parametrize("tree", ["dynamic", "static"])
@pytest.mark.parametrize("cached", [4, 2, 0])
def test_the_feed_of_a_tree_on_the_device_is_the_host_layout(tree, cached, reads_wait):
    """The target's tokens, mask and positions built on the device equal those laid out on the host for
    the tree it settles into, after 1, 3 or 5 uncached committed tokens. Control: an ancestor walk that
    stops one depth short of the root's children leaves the deepest nodes blind to them, and is caught."""
    lm, proposal, sequence = device_proposal(tree)
    device_tree = proposal.tree
    assert isinstance(device_tree, DeviceTree) and isinstance(device_tree.parents, torch.Tensor) == (tree == "dynamic")
    on_device = feed(cached, sequence, proposal)
    host = dataclasses.replace(proposal, tree=settled(proposal))
    assert max(host.tree.depths) >= 3, "a shallow tree would not test the ancestor walk"
    on_host = feed(cached, sequence, host)
    assert isinstance(on_device.tokens, torch.Tensor) and on_device.tokens.tolist() == on_host.tokens
    assert torch.equal(on_device.mask, on_host.mask) and torch.equal(on_device.positions, on_host.positions)
    assert on_device.logits_rows == on_host.logits_rows
    if tree == "dynamic":
        short = dataclasses.replace(proposal, tree=dataclasses.replace(device_tree, height=max(host.tree.depths) - 2))
        assert not torch.equal(feed(cached, sequence, short).mask, on_host.mask)


def test_a_device_tree_is_read_with_the_argmax(reads_wait):
    """Scores carry the tree's `read`, and the argmax rows hand its values back (on a GPU in one read)."""
    lm, proposal, sequence = device_proposal("dynamic")
    fed = feed(len(sequence) - 1, sequence, proposal)
    cache = lm.new_cache()
    lm.forward(sequence[:-1], cache)
    scores = score(lm, cache, fed, proposal)
    assert scores.read is proposal.tree.read
    assert scores.argmax_rows().also() == proposal.tree.read.tolist()
    tree = settled(proposal, scores)
    assert isinstance(tree, TokenTree) and proposal.tree is tree and tree.tokens[0] == sequence[-1]


@pytest.mark.parametrize("name", ["eagle-dynamic-10-3-4", "sequoia-8-4"])
def test_a_batch_reads_its_rows_trees_before_the_forward(name, reads_wait):
    """The batched forward is laid out on the host: each row's tree still on the device is read first
    (loop.settled), and every row decodes as autoregressive greedy."""
    from decoders.core.batch import decode_batch
    lm = tiny_lm(seed=2)
    prompts = [[3, 9, 4, 1] * 3, [5, 6, 7, 5, 6, 7, 5], [11]]
    gens, _ = decode_batch(DECODERS[name](), lm, prompts, 20, [GREEDY] * 3, set())
    assert reads_wait
    for prompt, gen in zip(prompts, gens):
        assert gen.tokens == autoregressive_decode(lm, prompt, 20, GREEDY, stop_ids=set()).tokens


@pytest.mark.parametrize("top_k", [0, 3])
def test_the_tree_rides_with_the_argmax_read_off_the_host(top_k, monkeypatch):
    """Where rows are read at once (a GPU, stood for by rows marked off the host), the tree's values come in
    the argmax's read, with each row's top-k where asked: one read, the same values as reading each alone.
    The control, the tree read apart, reads twice."""
    from decoders.core import sampling
    from decoders.core.sampling import ArgmaxRows
    rows = torch.randint(0, 5, (6, 40)).float()  # ties: argmax's first index is checked too
    tree = torch.tensor([3.0, 39.0, -1.0, 0.5, 2.0 ** 40])  # ids, a parent -1, a float32 score, a large id
    reads, real, real_argmax = [], torch.Tensor.tolist, sampling.argmax
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    monkeypatch.setattr(sampling, "argmax", lambda t, *maxima: reads.append(t.shape) or real_argmax(t, *maxima))

    def read(also):
        argmax_rows = ArgmaxRows(rows, top_k, also)
        argmax_rows.on_host = False
        reads.clear()
        got = argmax_rows.slice(), argmax_rows.top() if top_k else None, (
            argmax_rows.also() if also is not None else tree.double().tolist())
        return got, len(reads)

    (predicted, top, values), count = read(tree.double())
    assert count == 1 and predicted == real_argmax(rows) and values == real(tree.double())
    assert top == (real(torch.topk(rows, top_k).indices) if top_k else None)
    assert read(None)[1] == 2
