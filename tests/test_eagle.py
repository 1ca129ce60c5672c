"""EAGLE's feature draft: drafting in feature space is the computation it claims to be (every
tree node's features equal a fresh causal run along its own path; training's unrolled levels
equal drafting), its trees are what EAGLE-1 / EAGLE-2 build (skipping hopeless nodes leaves them as they are), its
file round-trips, draft_dtype converts the draft's own weights only, and sampling keeps the target's
distribution (with negative controls).

Greedy equality over trees and hyper-parameters lives in test_greedy_equality.py.
"""
from __future__ import annotations


import pytest
import torch

import decoders.core.loop as loop_module
from decoders.core.kv_cache import KVCache
from decoders.core.loop import feed, propose, score
from decoders.core.sampling import Sampling
from decoders.methods.eagle import Eagle, FeatureDraftProposer
from decoders.methods.eagle_draft import load_draft, new_draft, save_draft
from helpers import assert_stored_in_half, script_module, chi2_pvalue, round_to_half, tiny_lm
from test_lookahead import (LENGTH, N_CONTROL, N_SAMPLES, _verify_without_residual, assert_matches_exact,  # noqa: F401
                            exact_joint, sample_counts, stat_model, ALPHA)
from transformers import DynamicCache

train_eagle = script_module("scripts/train_eagle.py")
features, split_features, unrolled_levels = (train_eagle.features, train_eagle.split_features,
                                             train_eagle.unrolled_levels)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding, relative to the vector's size (random drafts reach |x| ~ 1e3,
    and oneDNN's multi-row kernels round differently from the one-row ones)."""
    return float((a - b).norm()) <= 1e-5 * float(b.norm()) + 1e-6


def fresh(draft, feats, tokens, chain):
    """The draft's output for the last node of `chain` [(token, ...)], run from an empty cache:
    the committed rows causally, then one node at a time, each reading its parent's output."""
    cache = KVCache(DynamicCache())
    n = len(tokens)
    out = draft(feats, torch.tensor(tokens), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache)[-1]
    for d, token in enumerate(chain):
        c = len(cache)
        out = draft(out[None], torch.tensor([token]), torch.tensor([n + d]), torch.ones(1, c + 1, dtype=torch.bool),
                    cache)[0]
    return out


def prefilled(lm, draft, prompt, **settings):
    """A proposer after the loop's first step (the prefill), and that step's committed rows."""
    proposer = FeatureDraftProposer(draft, **settings)
    sequence = list(prompt)
    proposal = propose(proposer, sequence, 10, prefill=True)
    assert len(proposal.tree) == 1 and proposal.feature_layers
    scores = score(lm, lm.new_cache(), feed(0, sequence, proposal), proposal)
    sequence.append(int(scores.logits[0].argmax()))
    proposer.commit(proposal, scores, [0], sequence)
    return proposer, sequence, scores.features, sequence[1:]


@pytest.mark.parametrize("tree,top_k", [("dynamic", 3), ("dynamic", 1), ("static", 3)])
@pytest.mark.parametrize("seed", range(3))
def test_every_node_is_a_fresh_causal_run_along_its_path(tree, top_k, seed):
    """Masks, positions and cache slots of tree drafting: node by node, the features the draft
    predicted equal a run from scratch along the node's own path."""
    lm = tiny_lm(seed=seed)
    draft = new_draft(lm, seed=seed + 1)
    template = Eagle(draft_weights=None, tree="static", tree_size=12, depth=4,
                     top_k=top_k).static_tree_for(draft, 12, 4)[0] if tree == "static" else None
    proposer, sequence, feats, tokens = prefilled(lm, draft, [3, 9, 4, 1, 7][:2 + seed], tree=tree, tree_size=12,
                                                  depth=4, top_k=top_k, template=template)
    proposal = proposer.propose(sequence, 10)
    nodes = proposer.nodes
    assert len(proposal.tree) > 1 and len(proposer.cache) == len(sequence) - 1  # tree rows cropped again
    checked = 0
    for node, g in proposer.node_features.items():
        chain, x = [], node
        while x > 0:
            chain.append(nodes.token[x])
            x = nodes.parent[x]
        with torch.inference_mode():
            ref = fresh(draft, feats, tokens, chain[::-1])
        assert close(g, ref), (node, chain)
        checked += 1
    assert checked >= 2


def test_dynamic_tree_is_eagle2_selection():
    """The tree holds the tree_size candidates of highest cumulative log-probability, closed under
    prefixes; top_k = 1 drafts the draft's own greedy chain."""
    lm = tiny_lm(seed=1)
    draft = new_draft(lm, seed=5)
    proposer, sequence, feats, tokens = prefilled(lm, draft, [3, 9, 4], tree="dynamic", tree_size=7, depth=4, top_k=3)
    tree = proposer.propose(sequence, 10).tree
    scores, nodes = proposer.nodes.score, proposer.nodes
    chosen = sorted(range(1, len(nodes.token)), key=lambda i: -scores[i])[:7]
    assert len(tree) == 8 and sorted(tree.tokens[1:]) == sorted(nodes.token[i] for i in chosen)
    assert all(tree.parents[i] < i for i in range(1, len(tree)))
    # top_k = 1: a chain, each token the draft's argmax after the one before
    proposer, sequence, feats, tokens = prefilled(lm, draft, [3, 9, 4], tree="dynamic", tree_size=4, depth=4, top_k=1)
    tree = proposer.propose(sequence, 10).tree
    assert tree.is_chain() and len(tree) == 5
    chain = []
    with torch.inference_mode():
        for _ in range(4):
            g = fresh(draft, feats, tokens, chain)
            chain.append(int(draft.vocab[draft.logits(g).argmax()]))
    assert tree.tokens[1:] == chain


@pytest.mark.parametrize("tree_size,depth,top_k", [(7, 4, 3), (8, 4, 8), (24, 6, 8), (3, 5, 2), (12, 3, 12)])
def test_skipping_hopeless_nodes_keeps_the_tree(tree_size, depth, top_k):
    """Expanding only the frontier nodes that can still reach the tree (prune, on a CPU) builds the
    same tree as expanding every top_k node at every depth, EAGLE-2 as written, with fewer rows fed."""
    saved = 0
    for seed in range(4):
        lm = tiny_lm(seed=seed)
        draft = new_draft(lm, seed=seed + 7)
        settings = dict(tree="dynamic", tree_size=tree_size, depth=depth, top_k=top_k)
        trees = []
        for prune in (True, False):
            proposer, sequence, _, _ = prefilled(lm, draft, [3, 9, 4, 1][:2 + seed % 3], **settings)
            proposer.prune = prune
            proposal = proposer.propose(sequence, 10)
            trees.append((proposal.tree.tokens, proposal.tree.parents, proposal.draft_forward_tokens))
        (tokens, parents, fed), (full_tokens, full_parents, full_fed) = trees
        assert (tokens, parents) == (full_tokens, full_parents)
        assert fed <= full_fed
        saved += full_fed - fed
    if tree_size < top_k * top_k:  # the second depth's candidates outnumber the tree: some node is hopeless
        assert saved > 0


@pytest.mark.parametrize("vocab", [None, [5, 9, 2, 40]])
def test_draft_dtype_converts_the_drafts_own_weights_only(vocab, tmp_path):
    """decoder.draft_dtype=bfloat16 beside a float32 target: the draft's layers and its own reduced
    readout go to bfloat16 (packed from 1 row, bfloat16's default, where oneDNN runs bfloat16 here); the
    target's head, shared by a whole-vocabulary draft, stays float32."""
    lm = tiny_lm(seed=0)
    head = lm.model.get_output_embeddings().weight
    save_draft(new_draft(lm, vocab, seed=3), tmp_path / "d.safetensors", {})
    draft = Eagle(draft_weights=str(tmp_path / "d.safetensors"), draft_dtype="bfloat16").load_addons(lm)
    assert draft.dtype == torch.bfloat16 and draft.layer.mlp.down_proj.weight.dtype == torch.bfloat16
    assert head.dtype == torch.float32 and lm.model.get_output_embeddings().weight.dtype == torch.float32
    assert draft.readout.weight.dtype == (torch.float32 if vocab is None else torch.bfloat16)
    if lm.fast_path == "prepacked":
        from decoders.core.fast_path import linear_problem
        assert lm.model.get_output_embeddings()._min_rows == lm.packed_min_rows
        if linear_problem(torch.bfloat16) is None:
            assert draft.fuse._min_rows == 1
        else:  # oneDNN cannot run bfloat16 on this CPU (no AVX-512, e.g. a Zen 3): the draft stays native
            assert type(draft.fuse) is torch.nn.Linear
    with torch.inference_mode():
        g = torch.randn(3, draft.fuse.weight.shape[0], dtype=torch.bfloat16)
        assert draft.logits(g).shape == (3, len(draft.vocab))
    with pytest.raises(ValueError, match="decoder.draft_dtype must be one of float32, bfloat16, float16, got 'fp8'"):
        Eagle(draft_dtype="fp8")


def test_room_limits_the_depth():
    lm = tiny_lm(seed=0)
    proposer, sequence, _, _ = prefilled(lm, new_draft(lm, seed=1), [3, 9, 4], tree="dynamic", tree_size=30,
                                         depth=6, top_k=4)
    assert max(proposer.propose(sequence, 2).tree.depths) == 2


@pytest.mark.parametrize("seed", range(3))
def test_training_levels_equal_drafting(seed):
    """train_eagle.py's unrolled level j at row t is what drafting computes at depth j + 1 after
    position t: training trains the computation decoding runs."""
    lm = tiny_lm(seed=seed)
    draft = new_draft(lm, seed=seed)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (1, 12), generator=g)
    with torch.inference_mode():
        _, feats = lm.forward(tokens[0], lm.new_cache(), features=True)
        levels = unrolled_levels(draft, feats[None], tokens, 3)
        for t in (0, 4, 8):
            for j in range(3):
                chain = tokens[0, t + 2:t + 2 + j].tolist()
                ref = fresh(draft, feats[:t + 1], tokens[0, 1:t + 2].tolist(), chain)
                assert close(levels[j][0, t], ref), (t, j)


def test_file_round_trip_keeps_weights_vocabulary_and_info(tmp_path):
    lm = tiny_lm(seed=0)
    vocab = [1, 5, 9, 20, 33, 60]
    draft = new_draft(lm, vocab=vocab, seed=3)
    round_to_half(draft)
    save_draft(draft, tmp_path / "d.safetensors", {"accuracy": [[0.5, 0.1], [0.3, 0.1]]})
    assert_stored_in_half(tmp_path / "d.safetensors")
    back = load_draft(lm, tmp_path / "d.safetensors")
    assert back.vocab.tolist() == vocab and back.accuracy() == [[0.5, 0.1], [0.3, 0.1]]
    for a, b in zip(draft.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        assert torch.allclose(back.logits(x), lm.model.get_output_embeddings()(lm.final_norm(x))[:, vocab], atol=1e-5)
    # drafted tokens come from the vocabulary only; the output is still exact
    dec = Eagle(draft_weights=str(tmp_path / "d.safetensors"), tree_size=8, depth=3, top_k=3)
    from decoders.methods.autoregressive import autoregressive_decode
    ref = autoregressive_decode(lm, [3, 4, 5], 20, Sampling(), set()).tokens
    assert dec.generate(lm, [3, 4, 5], 20, Sampling(), set()).tokens == ref
    assert dec.tuning["draft_vocab"] == len(vocab)


@pytest.mark.parametrize("seed", range(2))
def test_eagle3_training_reads_and_levels_equal_drafting(seed):
    """An EAGLE-3 draft in training (train_eagle.py --layout eagle3): the features the script stores
    are what decoding feeds the draft (LM.forward's features=draft.reads: layers 2, L/2, L-3's
    inputs) and the target's last layer's output (what its head reads), and unrolled level j at row
    t is what drafting computes at depth j + 1 after position t (fc applied to real rows only)."""
    from decoders.methods.published import Eagle3Draft, new_eagle3

    lm = tiny_lm(seed=seed, layers=8)
    torch.manual_seed(seed)
    draft = new_eagle3(lm, vocab=[1, 5, 9, 20, 33, 60])
    assert isinstance(draft, Eagle3Draft) and draft.reads == (2, 4, 5) and draft.vocab.tolist() == [1, 5, 9, 20, 33, 60]
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        inputs, last = split_features(draft, features(lm, tokens, False, draft.reads))
        logits, decoding = lm.forward(tokens[0], lm.new_cache(), features=draft.reads)
        assert inputs.shape == (1, 12, 3 * 64) and close(inputs[0], decoding)
        head = lm.model.get_output_embeddings()
        assert close(head(lm.final_norm(last[0])), logits)  # the teacher reads the target's own logits
        levels = unrolled_levels(draft, inputs, tokens, 3)
        for t in (0, 4, 8):
            for j in range(3):
                chain = tokens[0, t + 2:t + 2 + j].tolist()
                ref = fresh(draft, draft.from_target(inputs[0, :t + 1]), tokens[0, 1:t + 2].tolist(), chain)
                assert close(levels[j][0, t], ref), (t, j)


def test_eagle3_draft_trained_here_round_trips_in_the_authors_layout(tmp_path):
    """save_eagle3 writes the authors' layout (config.json + model.safetensors: fc, midlayer.*, norm,
    lm_head in float16, d2t, t2d), and decoder.draft_weights loads it back as an EAGLE-3 draft
    (not as our FeatureDraft, not as EAGLE-1) with the same weights, vocabulary and outputs and the
    accuracy its info records; decoding with it is exact."""
    import json

    from safetensors import safe_open

    from decoders.methods.autoregressive import autoregressive_decode
    from decoders.methods.published import Eagle3Draft, new_eagle3, save_eagle3

    lm = tiny_lm(seed=0, layers=8)
    torch.manual_seed(0)
    vocab = [1, 5, 9, 20, 33, 60]
    draft = new_eagle3(lm, vocab=vocab)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape) * 0.3)  # away from the target's head: a wrong readout would show
    round_to_half(draft)
    accuracy = [[0.5, 0.1], [0.3, 0.1]]
    save_eagle3(draft, tmp_path / "e3", {"accuracy": accuracy, "model": "model"}, "model")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == len(vocab)
    with safe_open(str(tmp_path / "e3" / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    assert stored["t2d"].dtype == torch.bool and stored["t2d"].nonzero().flatten().tolist() == vocab
    assert (stored["d2t"] + torch.arange(len(vocab))).tolist() == vocab
    assert {v.dtype for k, v in stored.items() if k not in ("d2t", "t2d")} == {torch.float16}
    assert any(k.startswith("midlayer.") for k in stored) and not any(k.startswith("layer.") for k in stored)

    back = load_draft(lm, tmp_path / "e3")
    assert isinstance(back, Eagle3Draft) and back.info["layout"] == "eagle3"
    assert back.vocab.tolist() == vocab and back.accuracy() == accuracy and back.reads == draft.reads
    assert back.state_dict().keys() == draft.state_dict().keys()
    for k, v in draft.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    x, tokens = torch.randn(5, 3 * 64), torch.tensor([3, 8, 1, 4, 2])
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.inference_mode():
        ours = draft.logits(draft(draft.from_target(x), tokens, torch.arange(5), mask))
        assert torch.allclose(back.logits(back(back.from_target(x), tokens, torch.arange(5), mask)), ours, atol=1e-5)
    reference = autoregressive_decode(lm, [3, 4, 5], 20, Sampling(), set()).tokens
    for tree in ("dynamic", "static"):
        dec = Eagle(draft_weights=str(tmp_path / "e3"), tree=tree, tree_size=8, depth=3, top_k=3)
        assert dec.generate(lm, [3, 4, 5], 20, Sampling(), set()).tokens == reference
        assert dec.tuning["draft_vocab"] == len(vocab)
    assert dec.tuning["source"] == "measured"  # the static tree came from the file's accuracy



def test_eagle3_draft_for_a_gemma_target(tmp_path):
    """A new EAGLE-3 draft for a Gemma 3 target (scripts/train_eagle.py --layout eagle3 on gemma3-270m):
    its config names Gemma's activation (hidden_activation) and the full-attention layers' rotary base;
    its norm starts as the target's final norm applies it (Gemma scales by 1 + weight); it round-trips
    through the authors' layout and drafts exactly."""
    import json

    from bench.models import TinyRandomModel
    from decoders.core.lm import LM
    from decoders.methods.autoregressive import autoregressive_decode
    from decoders.methods.published import new_eagle3, save_eagle3

    lm = LM(TinyRandomModel(family="gemma3", num_layers=8, sliding_window=8).build(64), name="gemma-like")
    text = lm.config.get_text_config()
    draft = new_eagle3(lm, vocab=[1, 5, 9, 20, 33, 60])
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert not torch.allclose(lm.final_norm.weight, torch.ones(64))  # 1 + weight differs from weight
        assert torch.allclose(draft.norm(x), lm.final_norm(x), atol=1e-5)
    save_eagle3(draft, tmp_path / "e3", {"model": "gemma-like"}, "gemma-like")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["hidden_act"] == text.hidden_activation
    assert config["rope_theta"] == text.rope_parameters["full_attention"]["rope_theta"] != \
        text.rope_parameters["sliding_attention"]["rope_theta"]
    reference = autoregressive_decode(lm, [3, 4, 5] * 4, 20, Sampling(), set()).tokens
    dec = Eagle(draft_weights=str(tmp_path / "e3"), tree_size=8, depth=3, top_k=3)
    assert dec.generate(lm, [3, 4, 5] * 4, 20, Sampling(), set()).tokens == reference


CASES = {
    # untrained drafts; top_k = 8 (the whole vocabulary) at depth 1 so that candidates are accepted often
    "eagle-dynamic-12-3-8-t0.8": (Eagle(draft_weights=None, tree_size=12, depth=3, top_k=8), dict(temperature=0.8),
                                  dict(temperature=1.0)),
    "eagle-static-8-1-8-t1.0-topk3": (Eagle(draft_weights=None, tree="static", tree_size=8, depth=1, top_k=8),
                                      dict(temperature=1.0, top_k=3), dict(temperature=1.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_sampling_matches_exact_distribution(stat_model, case):  # noqa: F811
    """Deterministic candidates (the draft's top-k) with the loop's verification: the 3-token
    outputs' counts against the exact joint distribution, and against a wrong one (control)."""
    lm, prompt = stat_model
    decoder, sampling_kwargs, wrong_kwargs = CASES[case]
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), sampling_kwargs,
                                      N_SAMPLES)
    assert hit_share >= 0.2, f"drafts accepted in only {hit_share:.0%} of steps: the test proves little"
    assert_matches_exact(lm, prompt, counts, sampling_kwargs, wrong_kwargs)


@pytest.mark.slow
def test_negative_control_eagle_with_a_wrong_verifier_is_rejected(stat_model, monkeypatch):  # noqa: F811
    lm, prompt = stat_model
    monkeypatch.setattr(loop_module, "verify_sampling", _verify_without_residual)
    decoder = Eagle(draft_weights=None, tree_size=3, depth=2, top_k=2)  # few candidates: the missing residual shows
    kwargs = dict(temperature=0.8)
    counts, hit_share = sample_counts(lambda s: decoder.generate(lm, prompt, LENGTH, s, set()), kwargs, N_CONTROL)
    assert hit_share > 0
    assert chi2_pvalue(counts, exact_joint(lm, prompt, Sampling(**kwargs))) < ALPHA


@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_eagle_auto_size_on_a_model_reports_its_choice(tmp_path, monkeypatch, tree):
    """tree_size=auto: the size and depth weighed for this device (tuning/tree_size.choose_size over
    the latency profile and one drafting depth, timed), reported, and the tree verified; output exact."""
    import decoders.methods.eagle as eagle_module
    from decoders.methods.autoregressive import autoregressive_decode

    lm = tiny_lm(seed=0)
    chosen = []
    choose = eagle_module.choose_size

    def spy(*args):
        chosen.append(choose(*args))
        return chosen[-1]
    monkeypatch.setattr(eagle_module, "choose_size", spy)
    eagle = Eagle(draft_weights=None, draft_seed=1, tree=tree, tree_size="auto", auto_sizes=[2, 6, 12], depth=4,
                  top_k=3, cache_dir=str(tmp_path))
    greedy = Sampling()
    gen = eagle.generate(lm, [1, 2, 3], 12, greedy, set())
    assert gen.tokens == autoregressive_decode(lm, [1, 2, 3], 12, greedy, set()).tokens
    size, info, table = chosen[0]
    assert [row["tree_size"] for row in table] == [2, 6, 12] and eagle.tuning["tree_size"] == size
    assert eagle.tuning["auto"] and eagle.tuning["depth_cost"] > 0 and eagle.tuning["depth"] == info["depth"]
    for row in table:  # a drafting depth is paid once per depth of the size's tree
        assert row["draft_cost"] == pytest.approx(row["depth"] * eagle.tuning["depth_cost"])
    assert max(step.forward_tokens for step in gen.steps[1:]) <= size + 1
    assert max(step.info["draft_depth"] for step in gen.steps[1:] if step.info) <= info["depth"]
    assert list((tmp_path / "latency").glob("*.json"))  # the profile, cached
    eagle.generate(lm, [4, 5], 4, greedy, set())
    assert len(chosen) == 1  # chosen once per draft
    with pytest.raises(ValueError, match="tree_size must be an integer >= 1 or auto"):
        Eagle(tree_size="big")
    with pytest.raises(ValueError, match="auto_sizes"):
        Eagle(auto_sizes=[])


def test_each_step_records_the_draft_forwards_it_ran(monkeypatch):
    """info["draft_forwards"] (what bench.forecast prices a step's draft by) counts the draft forwards
    the step ran: the committed rows', then one per depth fed. A dynamic tree may keep fewer depths
    than it drafted (its draft_depth), so on this seed some steps ran more forwards than they kept."""
    calls = []
    feed_rows = FeatureDraftProposer._feed

    def counted(self, *args):
        calls.append(len(args[1]))
        return feed_rows(self, *args)
    monkeypatch.setattr(FeatureDraftProposer, "_feed", counted)
    lm = tiny_lm(seed=0)
    eagle = Eagle(draft_weights=None, draft_seed=1, tree="dynamic", tree_size=3, depth=4, top_k=3)
    gen = eagle.generate(lm, [1, 2, 3], 16, Sampling(), set())
    infos = [step.info for step in gen.steps if step.info]
    assert sum(info["draft_forwards"] for info in infos) == len(calls)
    assert all(info["draft_depth"] <= info["draft_forwards"] <= 4 for info in infos)
    assert any(info["draft_forwards"] > info["draft_depth"] for info in infos)
