"""Block drafting (decoder=dflash): every block the proposer drafts is the draft's computation over the
committed rows (its cache kept and cropped right; one draft forward a step), the block's rows see the
context and each other and no later context, training runs the computation drafting runs, DDTree's tree
holds the most probable paths, tree_size=auto weighs one draft forward at every depth, the file round-trips,
and sampling keeps the target's distribution (with a negative control).

Greedy equality over hyper-parameters and model families lives in test_greedy_equality.py and
test_model_families.py; the exact enumeration of its verification in test_exact_verification.py.
"""
from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch
from transformers import DynamicCache

import decoders.core.loop as loop_module
from decoders.core.kv_cache import KVCache
from decoders.core.loop import feed, propose, score, verify
from decoders.core.sampling import Sampler, Sampling
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.block_draft import (BlockDraft, block_mask, block_reads, load_block_draft, new_block_draft,
                                          save_block_draft)
from decoders.methods.dflash import DFlash, ddtree
from helpers import REPO, assert_stored_in_half, chi2_pvalue, round_to_half, tiny_lm
from test_lookahead import (LENGTH, N_CONTROL, N_SAMPLES, _verify_without_residual, assert_matches_exact,  # noqa: F401
                            exact_joint, sample_counts, stat_model, ALPHA)

sys.path.insert(0, str(REPO / "scripts"))
from train_block_draft import block_logits  # noqa: E402

GREEDY = Sampling()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding, relative to the tensor's size (a cached and a fresh run sum in
    other orders)."""
    return float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-6


def decode_recording(lm, decoder: DFlash, prompt, n: int):
    """Decode greedily through the loop, recording every draft forward's inputs and output; returns the
    generation and the records (committed features fed, root, the draft cache's length before, output)."""
    draft = decoder.load_addons(lm)
    seen, forward = [], BlockDraft.forward

    def recording(features, root, cache, block=None):
        before = len(cache)
        out = forward(draft, features, root, cache, block)
        seen.append((features.clone(), root, before, out.clone()))
        return out

    draft.forward = recording
    try:
        gen = decoder.generate(lm, prompt, n, GREEDY, set())
    finally:
        del draft.forward
    return gen, seen


@pytest.mark.parametrize("seed", range(3))
def test_every_block_is_a_fresh_forward_over_every_committed_row(seed):
    """Each step's block equals one draft forward, from an empty cache, over every committed token's
    features (a fresh target pass over the committed text) and the block: the draft's cache kept the
    committed rows, in order, and dropped every block."""
    lm = tiny_lm(seed=seed)
    decoder = DFlash(draft_weights=None, draft_seed=seed + 1, tree_size=6, top_k=3, block_size=5)
    prompt = [3, 9, 4, 1, 7][:2 + seed]
    gen, seen = decode_recording(lm, decoder, prompt, 16)
    assert gen.tokens == autoregressive_decode(lm, prompt, 16, GREEDY, set()).tokens
    sequence = prompt + gen.tokens
    with torch.inference_mode():
        _, feats = lm.forward(sequence, lm.new_cache(), features=decoder.load_addons(lm).reads)
        draft = decoder.load_addons(lm)
        committed = 0
        for fed, root, before, out in seen:
            assert before == committed and sequence[before + len(fed)] == root  # the root follows the rows fed
            committed = before + len(fed)
            fresh = BlockDraft.forward(draft, feats[:committed], root, KVCache(DynamicCache()), 5)
            assert close(out, fresh), committed
    assert len(seen) == len([s for s in gen.steps[1:]]) >= 3  # one draft forward a step after the prefill


def test_block_rows_see_the_context_and_each_other_and_context_rows_only_what_came_before():
    assert block_mask(2, 1, 3).int().tolist() == [[1, 1, 0, 0, 0, 0],
                                                  [1, 1, 1, 0, 0, 0],
                                                  [1, 1, 1, 1, 1, 1],
                                                  [1, 1, 1, 1, 1, 1],
                                                  [1, 1, 1, 1, 1, 1]]
    # and the draft computes with it: a block row changes with every committed row and with the other
    # block rows (a mask row after it included), a context row never with a later row
    lm = tiny_lm(seed=0)
    draft = new_block_draft(lm, seed=2)
    reads = torch.randn(4, 3 * 64)
    with torch.inference_mode():
        base = draft(reads, 5, KVCache(DynamicCache()), 4)
        other = reads.clone()
        other[0] += 1
        assert not torch.allclose(draft(other, 5, KVCache(DynamicCache()), 4), base)
        assert not torch.allclose(draft(reads, 6, KVCache(DynamicCache()), 4)[1], base[1])  # the root, row 0
        x = draft.block_inputs(reads, torch.tensor([5]), 4)
        mask = block_mask(4, 0, 4)
        h = draft.run(x[None], torch.arange(8), mask)[0]
        x[6] += 1  # a later mask row moves row 5 (bidirectional) but no context row (causal to the context)
        h2 = draft.run(x[None], torch.arange(8), mask)[0]
        assert not torch.allclose(h2[5], h[5]) and torch.equal(h2[:4], h[:4])


@pytest.mark.parametrize("seed", range(2))
def test_training_runs_the_computation_drafting_runs(seed):
    """train_block_draft.py's forward at anchor a (many anchors in one forward) gives the logits a
    draft forward gives for the root token a after the committed rows before it."""
    lm = tiny_lm(seed=seed)
    draft = new_block_draft(lm, seed=seed + 3)
    tokens = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        _, feats = lm.forward(tokens[0], lm.new_cache(), features=draft.reads)
        anchors = [1, 6, 7, 13]
        trained = block_logits(draft, feats[None], tokens, anchors, 5)[0]  # (A, 4, V')
        for j, a in enumerate(anchors):
            out = draft(feats[:a], int(tokens[0, a]), KVCache(DynamicCache()), 5)
            assert close(trained[j], draft.logits(out[1:])), a


def brute_force_best(probs: torch.Tensor, size: int) -> set[tuple[int, ...]]:
    """Every rank path up to the block's depth, by probability (the product of its positions')."""
    depth, k = probs.shape
    paths = [p for n in range(1, depth + 1) for p in itertools.product(range(k), repeat=n)]
    value = {p: math.prod(float(probs[i, r]) for i, r in enumerate(p)) for p in paths}
    return set(sorted(paths, key=lambda p: -value[p])[:size])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("size", [1, 4, 9, 20])
def test_ddtree_is_the_most_probable_paths(seed, size):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(4, 6, generator=g) * 2, -1).sort(-1, descending=True)
    top, ids = probs.values[:, :3], probs.indices[:, :3] + 10  # (depth 4, k 3): each position's top 3
    tree = ddtree(7, top, ids, size)
    assert len(tree) == size + 1 and tree.tokens[0] == 7 and all(tree.parents[i] < i for i in range(1, len(tree)))
    ranks = {tuple(int((ids[d] == tree.tokens[i]).nonzero()) for d, i in enumerate(tree.path(node)[1:]))
             for node in range(1, len(tree))}
    assert ranks == brute_force_best(top, size)


def test_chain_tree_and_room():
    lm = tiny_lm(seed=1)
    decoder = DFlash(draft_weights=None, draft_seed=4, tree="chain", block_size=6)
    proposer, _ = decoder.proposer(lm, [3, 9, 4], Sampler(GREEDY, lm.output_device), set())
    sequence = [3, 9, 4]
    first = propose(proposer, sequence, 10, prefill=True)
    scores = score(lm, lm.new_cache(), feed(0, sequence, first), first)
    path, bonus = verify(first, scores, Sampler(GREEDY, lm.output_device))
    sequence.append(bonus)
    proposer.commit(first, scores, path, sequence)
    draft = decoder.load_addons(lm)
    with torch.inference_mode():
        _, feats = lm.forward(sequence[:-1], lm.new_cache(), features=draft.reads)
        out = draft(feats, sequence[-1], KVCache(DynamicCache()), 6)
        argmax = draft.vocab[draft.logits(out[1:]).argmax(-1)].tolist()
    cache = len(proposer.cache)
    chain = proposer.propose(sequence, 10).tree
    assert chain.is_chain() and chain.tokens[1:] == argmax  # the block's argmax, position by position
    proposer.cache.crop(cache)
    proposer.pending = feats[cache:]
    assert len(proposer.propose(sequence, 2).tree) == 3  # no drafts past max_new_tokens
    # a tree of one rank per position is the chain
    tree_decoder = DFlash(draft_weights=None, draft_seed=4, tree="tree", tree_size=5, top_k=1, block_size=6)
    tree_proposer, _ = tree_decoder.proposer(lm, [3, 9, 4], Sampler(GREEDY, lm.output_device), set())
    tree_proposer.pending = feats
    assert tree_proposer.propose(sequence, 10).tree.tokens == chain.tokens


def test_a_drawn_chain_hands_verification_the_rows_it_was_drawn_from():
    """Sampling, tree=chain: node c's token is drawn from row c of the proposal's draft_probs, which is the
    run's sampling distribution (temperature, top-k) over the draft's logits at block position c, each
    position its own; the root's row is empty. The same generator state draws the same tokens from them."""
    lm = tiny_lm(seed=2)
    sampling = Sampling(temperature=0.7, top_k=20, seed=3)
    decoder = DFlash(draft_weights=None, draft_seed=6, tree="chain", block_size=5)
    sampler = Sampler(sampling, lm.output_device)
    proposer, _ = decoder.proposer(lm, [3, 9, 4], sampler, set())
    draft = decoder.load_addons(lm)
    sequence = [3, 9, 4, 11]
    with torch.inference_mode():
        _, feats = lm.forward(sequence[:-1], lm.new_cache(), features=draft.reads)
        out = draft(feats, sequence[-1], KVCache(DynamicCache()), 5)
        full = torch.full((4, lm.vocab_size), float("-inf")).index_copy_(1, draft.vocab, draft.logits(out[1:]))
        rows = sampler.probs(full)
    proposer.pending = feats
    state = sampler.generator.get_state()
    proposal = proposer.propose(sequence, 10)
    assert torch.equal(proposal.draft_probs[0], torch.zeros(lm.vocab_size))
    assert close(proposal.draft_probs[1:], rows) and len({tuple(r.tolist()) for r in rows}) == 4
    assert all(rows[i, t] > 0 for i, t in enumerate(proposal.tree.tokens[1:]))
    sampler.generator.set_state(state)
    assert proposal.tree.tokens[1:] == torch.multinomial(rows, 1, generator=sampler.generator)[:, 0].tolist()


def test_file_round_trip_keeps_weights_shape_vocabulary_and_info(tmp_path):
    lm = tiny_lm(seed=0, layers=3)
    vocab = [1, 5, 9, 20, 33, 60]
    draft = new_block_draft(lm, reads=(0, 1, 2), layers=2, intermediate_size=24, vocab=vocab, block_size=6, seed=3)
    round_to_half(draft)
    save_block_draft(draft, tmp_path / "b.safetensors", {"accuracy": [[0.5, 0.1], [0.3, 0.1]]})
    assert_stored_in_half(tmp_path / "b.safetensors")
    back = load_block_draft(lm, tmp_path / "b.safetensors")
    assert back.vocab.tolist() == vocab and back.reads == (0, 1, 2) and len(back.layers) == 2
    assert back.intermediate_size == 24 and back.block_size == 6 and back.accuracy() == [[0.5, 0.1], [0.3, 0.1]]
    for (name, a), b in zip(draft.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="is not a block draft file"):
        from decoders.methods.eagle_draft import new_draft, save_draft
        save_draft(new_draft(lm), tmp_path / "e.safetensors", {})
        load_block_draft(lm, tmp_path / "e.safetensors")
    with pytest.raises(ValueError, match=r"reads target layers in \[0, 2\)"):
        load_block_draft(tiny_lm(seed=0), tmp_path / "b.safetensors")  # a target of 2 layers: no layer 2
    assert block_reads(tiny_lm(seed=0)) == (0, 1, 1) and block_reads(tiny_lm(seed=0, layers=8)) == (2, 4, 5)
    reference = autoregressive_decode(lm, [3, 4, 5], 20, GREEDY, set()).tokens
    for tree in ("chain", "tree"):
        dec = DFlash(draft_weights=str(tmp_path / "b.safetensors"), tree=tree, tree_size=4, block_size=6)
        assert dec.generate(lm, [3, 4, 5], 20, GREEDY, set()).tokens == reference
        assert dec.tuning["draft_vocab"] == len(vocab)


def test_auto_size_weighs_one_draft_forward_at_every_depth(tmp_path, monkeypatch):
    import decoders.methods.dflash as dflash_module

    lm = tiny_lm(seed=0)
    chosen, choose = [], dflash_module.choose_size

    def spy(*args):
        chosen.append(choose(*args))
        return chosen[-1]
    monkeypatch.setattr(dflash_module, "choose_size", spy)
    decoder = DFlash(draft_weights=None, draft_seed=1, tree_size="auto", auto_sizes=[2, 6, 40], top_k=2, block_size=5,
                     cache_dir=str(tmp_path))
    gen = decoder.generate(lm, [1, 2, 3], 12, GREEDY, set())
    assert gen.tokens == autoregressive_decode(lm, [1, 2, 3], 12, GREEDY, set()).tokens
    size, info, table = chosen[0]
    assert [row["tree_size"] for row in table] == [2, 6, 40] and decoder.tuning["tree_size"] == size
    assert decoder.tuning["auto"] and decoder.tuning["source"] == "prior" and decoder.tuning["draft_cost"] > 0
    assert {row["draft_cost"] for row in table} == {decoder.tuning["draft_cost"]}  # whatever the tree's depth
    assert table[-1]["depth"] == 4  # 40 nodes of 2 ranks reach no deeper than the block's 4 drafted positions
    assert max(step.forward_tokens for step in gen.steps[1:]) <= size + 1
    decoder.generate(lm, [4, 5], 4, GREEDY, set())
    assert len(chosen) == 1  # chosen once per draft
    with pytest.raises(ValueError, match="decoder.tree must be one of chain, tree"):
        DFlash(tree="dynamic")
    with pytest.raises(ValueError, match="decoder.block_size must be an integer >= 2"):
        DFlash(block_size=1)


def test_each_step_records_one_draft_forward():
    lm = tiny_lm(seed=0)
    gen, seen = decode_recording(lm, DFlash(draft_weights=None, draft_seed=1, tree_size=4, block_size=4), [1, 2, 3], 16)
    infos = [step.info for step in gen.steps if step.info]
    assert len(infos) == len(seen) and all(info["draft_forwards"] == 1 for info in infos)
    assert gen.steps[1].draft_prefill_flops > 0 and all(s.draft_prefill_flops == 0 for s in gen.steps[2:])
    assert all(s.draft_forward_tokens == len(fed) + 4 for s, (fed, _, _, _) in zip(gen.steps[1:], seen))


def uniform(decoder: DFlash, lm) -> DFlash:
    """`decoder` with a draft whose every position's distribution is uniform over the vocabulary (the mask
    rows' input and the layer's residual branches zero: their output is zero, read out as equal logits), so
    that its drawn chains are accepted often under the test's peaked target."""
    draft = decoder.load_addons(lm)
    with torch.no_grad():
        draft.mask.zero_()
        for name, p in draft.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
    return decoder


CASES = {
    # block of 3 (2 drafted positions) over the whole 8-token vocabulary: chains drawn from a uniform draft
    # (accepted in about 12% of steps: the target is peaked; a drawn chain's rows are checked one by one in
    # test_a_drawn_chain_hands_verification_the_rows_it_was_drawn_from), and DDTree's deterministic trees of
    # an untrained one; the share of steps with an accepted draft each case needs
    "dflash-chain-t0.8": (lambda lm: uniform(DFlash(draft_weights=None, tree="chain", block_size=3), lm),
                          dict(temperature=0.8), dict(temperature=1.0), 0.08),
    "dflash-tree-6-t1.0-topk3": (lambda lm: DFlash(draft_weights=None, tree_size=6, top_k=4, block_size=3),
                                 dict(temperature=1.0, top_k=3), dict(temperature=1.0), 0.2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_sampling_matches_exact_distribution(stat_model, case):  # noqa: F811
    """The proposer's own draws (a chain) and trees through the loop's verification: the 3-token outputs'
    counts against the exact joint distribution, and against a wrong one (control)."""
    lm, prompt = stat_model
    make, sampling_kwargs, wrong_kwargs, least = CASES[case]
    decoder = make(lm)
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), sampling_kwargs,
                                      N_SAMPLES)
    assert hit_share >= least, f"drafts accepted in only {hit_share:.0%} of steps: the test proves little"
    assert_matches_exact(lm, prompt, counts, sampling_kwargs, wrong_kwargs)


@pytest.mark.slow
def test_negative_control_dflash_with_a_wrong_verifier_is_rejected(stat_model, monkeypatch):  # noqa: F811
    lm, prompt = stat_model
    monkeypatch.setattr(loop_module, "verify_sampling", _verify_without_residual)
    decoder = DFlash(draft_weights=None, tree_size=2, top_k=2, block_size=3)
    kwargs = dict(temperature=0.8)
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), kwargs, N_CONTROL)
    assert hit_share > 0
    assert chi2_pvalue(counts, exact_joint(lm, prompt, Sampling(**kwargs))) < ALPHA
